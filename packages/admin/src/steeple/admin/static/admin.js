// steeple admin dashboard: operator actions. Served by the app itself (no inline script).
// Each action is a same-origin JSON POST with the page's CSRF token in X-Steeple-CSRF.
"use strict";

document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-action]");
  if (!button) {
    return;
  }
  const meta = document.querySelector('meta[name="steeple-csrf"]');
  const namespace = document.body.dataset.namespace;
  if (!meta || !namespace || !window.confirm(button.dataset.confirm)) {
    return;
  }
  button.disabled = true;
  const response = await fetch(
    `../api/${encodeURIComponent(namespace)}/${button.dataset.action}`,
    {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Steeple-CSRF": meta.content },
      body: button.dataset.body,
    },
  );
  if (response.ok) {
    window.location.reload();
    return;
  }
  let detail = response.statusText;
  try {
    detail = (await response.json()).detail || detail;
  } catch (_) {
    // not JSON: keep the status text
  }
  window.alert(`${button.dataset.action} failed: ${detail}`);
  button.disabled = false;
});
