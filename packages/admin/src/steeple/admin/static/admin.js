// steeple admin dashboard: actions, live refresh and the throughput chart. Served by the app
// itself (no CDN, no inline script: the CSP forbids both). Every action is a same-origin JSON
// POST carrying the page's CSRF token in X-Steeple-CSRF, after a confirmation in the page.
"use strict";

(() => {
  const body = document.body;
  const api = body.dataset.api;
  const tokenMeta = document.querySelector('meta[name="steeple-csrf"]');
  const dialog = document.getElementById("confirm");
  const SVG = "http://www.w3.org/2000/svg";
  let busy = false;

  function flash(text, kind) {
    const el = document.getElementById("flash");
    if (!el) {
      return;
    }
    el.textContent = text;
    el.className = kind;
  }

  async function detailOf(response) {
    try {
      const data = await response.json();
      return data.detail || response.statusText;
    } catch (_) {
      return response.statusText || String(response.status);
    }
  }

  async function post(action, payload) {
    const response = await fetch(`${api}/${action}`, {
      method: "POST",
      credentials: "same-origin",
      headers: {
        "Content-Type": "application/json",
        "X-Steeple-CSRF": tokenMeta ? tokenMeta.content : "",
      },
      body: JSON.stringify(payload),
    });
    if (!response.ok) {
      throw new Error(await detailOf(response));
    }
    return response.json();
  }

  // Ask in the page's own dialog; resolve with the typed values, or null when backed out.
  function ask(message, fields) {
    return new Promise((resolve) => {
      document.getElementById("confirm-text").textContent = message;
      const holder = document.getElementById("confirm-fields");
      holder.replaceChildren();
      for (const [name, label] of Object.entries(fields)) {
        const wrap = document.createElement("label");
        wrap.textContent = `${label} `;
        const input = document.createElement("input");
        input.name = name;
        input.id = `confirm-field-${name}`;
        input.autocomplete = "off";
        wrap.appendChild(input);
        holder.appendChild(wrap);
      }
      dialog.addEventListener(
        "close",
        () => {
          if (dialog.returnValue !== "ok") {
            resolve(null);
            return;
          }
          const values = {};
          for (const input of holder.querySelectorAll("input")) {
            const value = input.value.trim();
            if (value !== "") {
              // Ages are whole numbers in the API; everything else travels as text.
              const numeric = input.name.startsWith("older_than") && /^[0-9]{1,6}$/.test(value);
              values[input.name] = numeric ? Number(value) : value;
            }
          }
          resolve(values);
        },
        { once: true },
      );
      dialog.returnValue = "";
      dialog.showModal();
    });
  }

  function plural(count, noun) {
    return `${count} ${count === 1 ? noun : `${noun}s`}`;
  }

  // What an action did, in words: the button says it (data-done), with the counts the
  // answer gives; never an API path.
  function summary(button, result) {
    const noun = button.dataset.noun || "task";
    if (result.purged !== undefined) {
      return `${plural(result.purged, `finished ${noun}`)} removed`;
    }
    for (const key of ["cancelled", "retried"]) {
      if (Array.isArray(result[key])) {
        const skipped = Object.keys(result.skipped || {}).length;
        const rest = skipped ? ` (${plural(skipped, "task")} skipped: already finished)` : "";
        return `${key} ${plural(result[key].length, "task")}${rest}`;
      }
    }
    return button.dataset.done || "done";
  }

  async function act(button) {
    const action = button.dataset.action;
    let payload = JSON.parse(button.dataset.body || "{}");
    if (button.dataset.preview) {
      const preview = await post(action, payload);
      if (preview.task_ids.length === 0) {
        flash(`no matching task to ${button.dataset.confirm.toLowerCase()}`, "info");
        return;
      }
      const shown = preview.task_ids.slice(0, 20).join(", ");
      const more = preview.task_ids.length > 20 ? ", ..." : "";
      const rest = preview.more ? " (the first batch; more match: repeat after this)" : "";
      const ok = await ask(
        `${button.dataset.confirm} ${plural(preview.task_ids.length, "task")}${rest}: ${shown}${more}?`,
        {},
      );
      if (ok === null) {
        return;
      }
      payload = { task_ids: preview.task_ids };
    } else {
      const fields = JSON.parse(button.dataset.fields || "{}");
      const values = await ask(button.dataset.confirm, fields);
      if (values === null) {
        return;
      }
      payload = { ...payload, ...values };
    }
    const result = await post(action, payload);
    flash(summary(button, result), "ok");
  }

  async function run(what, work) {
    if (busy) {
      return;
    }
    busy = true;
    flash("", ""); // the outcome shown is always this action's
    try {
      await work();
    } catch (error) {
      flash(`${what} failed: ${error.message}`, "error");
    } finally {
      busy = false;
    }
    await refresh();
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button && tokenMeta) {
      run(button.dataset.action, () => act(button));
      return;
    }
    const reveal = event.target.closest("button[data-reveal]");
    if (reveal) {
      run("show args", async () => {
        const response = await fetch(`${api}/tasks/${reveal.dataset.reveal}/args`, {
          credentials: "same-origin",
        });
        if (!response.ok) {
          throw new Error(await detailOf(response));
        }
        const data = await response.json();
        const pre = document.getElementById("args-text");
        pre.textContent = JSON.stringify(data.args, null, 2);
        pre.hidden = false;
        reveal.hidden = true;
      });
    }
  });

  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form[data-action]");
    if (!form || !tokenMeta) {
      return;
    }
    event.preventDefault();
    run(form.dataset.action, async () => {
      const data = Object.fromEntries(new FormData(form).entries());
      let args;
      try {
        args = JSON.parse(data.args || "null");
      } catch (_) {
        throw new Error("args is not valid JSON");
      }
      const result = await post(form.dataset.action, { ...data, args });
      flash(`created job ${result.name}`, "ok");
      form.reset();
    });
  });

  // --- live refresh: the page's own ?live=1 answers the inner HTML of its live sections ---

  async function refresh() {
    if ((dialog && dialog.open) || busy || !document.querySelector("[data-live]")) {
      return;
    }
    const url = new URL(window.location.href);
    url.searchParams.set("live", "1");
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin" });
    } catch (_) {
      flash("cannot reach the admin app; retrying", "error");
      return;
    }
    if (!response.ok) {
      flash(`refresh failed: ${await detailOf(response)}`, "error");
      return;
    }
    const data = await response.json();
    for (const [id, html] of Object.entries(data.live)) {
      const section = document.getElementById(id);
      if (section) {
        section.innerHTML = html; // rendered and escaped by the app, as the page itself
      }
    }
    drawCharts();
    drawGraphs();
    const stamp = document.getElementById("updated");
    if (stamp) {
      stamp.textContent = `updated ${data.at.slice(11, 19)} UTC`;
    }
  }

  function tick() {
    const live = document.getElementById("live-toggle");
    if (live && live.checked && !document.hidden) {
      refresh();
    }
  }

  // --- the throughput chart: stacked bars per minute, drawn as SVG from the data --------

  function niceStep(peak) {
    // A y-axis step of 1, 2 or 5 times a power of ten, for about four gridlines.
    const rough = peak / 4;
    const power = 10 ** Math.floor(Math.log10(Math.max(rough, 1)));
    for (const m of [1, 2, 5, 10]) {
      if (m * power >= rough) {
        return Math.max(1, m * power);
      }
    }
    return Math.max(1, 10 * power);
  }

  function svgNode(name, attributes, text) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) {
      node.setAttribute(key, String(value));
    }
    if (text !== undefined) {
      node.textContent = text;
    }
    return node;
  }

  function drawCharts() {
    for (const figure of document.querySelectorAll("figure[data-series]")) {
      const series = JSON.parse(figure.dataset.series);
      const states = Object.keys(series.finished);
      const n = states.length ? series.finished[states[0]].length : 0;
      const totals = Array.from({ length: n }, (_, i) =>
        states.reduce((sum, s) => sum + series.finished[s][i], 0),
      );
      const plot = figure.querySelector(".plot");
      // Drawn at the plot's own width in pixels: the chart fills its frame, never letterboxed.
      const width = Math.max(240, Math.floor(plot.clientWidth || 600));
      const height = 150;
      const left = 36;
      const bottom = 18;
      const top = 6;
      const inner = height - bottom - top;
      const step = niceStep(Math.max(1, ...totals));
      const peak = step * Math.ceil(Math.max(1, ...totals) / step);
      const bar = (width - left) / Math.max(1, n);
      const minutes = Math.round((n * series.bucket_seconds) / 60);
      const svg = svgNode("svg", {
        viewBox: `0 0 ${width} ${height}`,
        width,
        height,
        role: "img",
        "aria-label": `tasks finished per minute over the last ${minutes} minutes, at most ${Math.max(0, ...totals)} in one minute`,
      });
      const y = (value) => top + inner - (value / peak) * inner;
      // The y-axis: gridlines and labels at each step (tasks per minute).
      for (let value = 0; value <= peak; value += step) {
        svg.appendChild(
          svgNode("line", { x1: left, x2: width, y1: y(value), y2: y(value), class: "grid" }),
        );
        svg.appendChild(
          svgNode(
            "text",
            { x: left - 4, y: y(value) + 4, "text-anchor": "end", class: "tick y-tick" },
            String(value),
          ),
        );
      }
      svg.appendChild(svgNode("line", { x1: left, x2: left, y1: top, y2: top + inner, class: "axis" }));
      svg.appendChild(
        svgNode("line", { x1: left, x2: width, y1: top + inner, y2: top + inner, class: "axis" }),
      );
      for (let i = 0; i < n; i += 1) {
        let stacked = 0;
        for (const state of states) {
          const count = series.finished[state][i];
          if (!count) {
            continue;
          }
          const rect = svgNode("rect", {
            x: left + i * bar + 0.5,
            y: y(stacked + count),
            width: Math.max(1, bar - 1),
            height: y(stacked) - y(stacked + count),
            class: `bar state-${state}`,
          });
          rect.appendChild(svgNode("title", {}, `${count} ${state}, ${n - i} min ago`));
          svg.appendChild(rect);
          stacked += count;
        }
      }
      // The x-axis: minutes ago, every quarter of the window.
      for (let q = 0; q <= 4; q += 1) {
        const ago = Math.round((minutes * (4 - q)) / 4);
        const anchor = q === 0 ? "start" : q === 4 ? "end" : "middle";
        svg.appendChild(
          svgNode(
            "text",
            { x: left + ((width - left) * q) / 4, y: height - 4, "text-anchor": anchor, class: "tick x-tick" },
            ago ? `-${ago} min` : "now",
          ),
        );
      }
      plot.replaceChildren(svg);
    }
  }

  // --- a workflow: each task a box, in columns by depth, an arrow from each task it waits for

  function drawGraphs() {
    for (const figure of document.querySelectorAll("figure[data-graph]")) {
      const tasks = JSON.parse(figure.dataset.graph).tasks;
      const byId = new Map(tasks.map((t) => [t.id, t]));
      const depth = new Map();
      // Tasks come in id order and wait only for tasks of lower ids (or outside the graph).
      for (const t of tasks) {
        const ups = t.after.filter((id) => depth.has(id));
        depth.set(t.id, ups.length ? 1 + Math.max(...ups.map((id) => depth.get(id))) : 0);
      }
      const columns = [];
      for (const t of tasks) {
        const d = depth.get(t.id);
        (columns[d] = columns[d] || []).push(t);
      }
      const boxW = 150;
      const boxH = 30;
      const gapX = 50;
      const gapY = 14;
      const tallest = Math.max(1, ...columns.map((c) => c.length));
      const width = columns.length * (boxW + gapX) - gapX + 8;
      const height = tallest * (boxH + gapY) - gapY + 8;
      const at = new Map();
      columns.forEach((column, d) =>
        column.forEach((t, i) => at.set(t.id, { x: 4 + d * (boxW + gapX), y: 4 + i * (boxH + gapY) })),
      );
      const svg = svgNode("svg", {
        viewBox: `0 0 ${width} ${height}`,
        width,
        height,
        role: "img",
        "aria-label": `workflow of ${tasks.length} tasks`,
      });
      for (const t of tasks) {
        for (const up of t.after) {
          if (!byId.has(up)) {
            continue;
          }
          const a = at.get(up);
          const b = at.get(t.id);
          svg.appendChild(
            svgNode("path", {
              d: `M${a.x + boxW},${a.y + boxH / 2} C${a.x + boxW + gapX / 2},${a.y + boxH / 2} ${b.x - gapX / 2},${b.y + boxH / 2} ${b.x},${b.y + boxH / 2}`,
              class: "edge",
              "data-from": up,
              "data-to": t.id,
            }),
          );
        }
      }
      for (const t of tasks) {
        const p = at.get(t.id);
        const group = svgNode("g", { class: "node", "data-task": t.id, "data-state": t.state });
        const box = svgNode("rect", { x: p.x, y: p.y, width: boxW, height: boxH, rx: 5, class: `state-${t.state}` });
        box.appendChild(svgNode("title", {}, `task ${t.id} ${t.name}: ${t.state}`));
        group.appendChild(box);
        const label = `${t.id} ${t.name}`;
        group.appendChild(
          svgNode(
            "text",
            { x: p.x + 8, y: p.y + boxH / 2 + 4, class: `state-${t.state}` },
            label.length > 22 ? `${label.slice(0, 21)}…` : label,
          ),
        );
        svg.appendChild(group);
      }
      figure.querySelector(".plot").replaceChildren(svg);
    }
  }

  let resized = null;
  window.addEventListener("resize", () => {
    window.clearTimeout(resized);
    resized = window.setTimeout(drawCharts, 150);
  });

  drawCharts();
  drawGraphs();
  const period = Math.max(1, Number(body.dataset.refresh || "5")) * 1000;
  window.setInterval(tick, period);
})();
