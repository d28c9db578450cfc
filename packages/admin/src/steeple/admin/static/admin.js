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

  function summary(action, result) {
    if (result.purged !== undefined) {
      return `${action}: ${result.purged} removed`;
    }
    for (const key of ["cancelled", "retried"]) {
      if (Array.isArray(result[key])) {
        const skipped = Object.keys(result.skipped || {}).length;
        return `${key} ${result[key].length} task(s)` + (skipped ? `, ${skipped} skipped` : "");
      }
    }
    return `${action}: done`;
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
        `${button.dataset.confirm} ${preview.task_ids.length} task(s)${rest}: ${shown}${more}?`,
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
    flash(summary(action, result), "ok");
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

  function drawCharts() {
    for (const figure of document.querySelectorAll("figure[data-series]")) {
      const series = JSON.parse(figure.dataset.series);
      const states = Object.keys(series.finished);
      const n = states.length ? series.finished[states[0]].length : 0;
      const totals = Array.from({ length: n }, (_, i) =>
        states.reduce((sum, s) => sum + series.finished[s][i], 0),
      );
      const peak = Math.max(1, ...totals);
      const width = 600;
      const height = 120;
      const bar = width / Math.max(1, n);
      const svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("viewBox", `0 0 ${width} ${height + 16}`);
      svg.setAttribute("role", "img");
      svg.setAttribute("aria-label", `tasks finished per minute, peak ${peak}`);
      const axis = document.createElementNS(SVG, "line");
      axis.setAttribute("x1", "0");
      axis.setAttribute("x2", String(width));
      axis.setAttribute("y1", String(height));
      axis.setAttribute("y2", String(height));
      axis.setAttribute("class", "axis");
      svg.appendChild(axis);
      for (let i = 0; i < n; i += 1) {
        let top = height;
        for (const state of states) {
          const count = series.finished[state][i];
          if (!count) {
            continue;
          }
          const h = (count / peak) * (height - 4);
          const rect = document.createElementNS(SVG, "rect");
          rect.setAttribute("x", String(i * bar + 0.5));
          rect.setAttribute("y", String(top - h));
          rect.setAttribute("width", String(Math.max(1, bar - 1)));
          rect.setAttribute("height", String(h));
          rect.setAttribute("class", `bar state-${state}`);
          const title = document.createElementNS(SVG, "title");
          title.textContent = `${count} ${state}, ${n - i} min ago`;
          rect.appendChild(title);
          svg.appendChild(rect);
          top -= h;
        }
      }
      for (const [x, label, anchor] of [
        [0, "-60 min", "start"],
        [width, `peak ${peak}/min · now`, "end"],
      ]) {
        const text = document.createElementNS(SVG, "text");
        text.setAttribute("x", String(x));
        text.setAttribute("y", String(height + 13));
        text.setAttribute("text-anchor", anchor);
        text.setAttribute("class", "tick");
        text.textContent = label;
        svg.appendChild(text);
      }
      const plot = figure.querySelector(".plot");
      plot.replaceChildren(svg);
    }
  }

  drawCharts();
  const period = Math.max(1, Number(body.dataset.refresh || "5")) * 1000;
  window.setInterval(tick, period);
})();
