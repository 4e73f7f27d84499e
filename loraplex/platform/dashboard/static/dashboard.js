// loraplex admin: auto-refresh of live panels, confirmation of destructive forms, copy of a new key.
"use strict";

document.addEventListener("submit", (e) => {
  const message = e.target.dataset && e.target.dataset.confirm;
  if (message && !window.confirm(message)) e.preventDefault();
});

document.addEventListener("click", async (e) => {
  const button = e.target.closest("[data-copy]");
  if (!button) return;
  const text = document.querySelector(button.dataset.copy).textContent.trim();
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (_) {
    window.getSelection().selectAllChildren(document.querySelector(button.dataset.copy));
  }
});

// <div data-refresh="/admin/ui/..." data-interval="5000">: reload its HTML while the tab is visible.
for (const el of document.querySelectorAll("[data-refresh]")) {
  const every = Number(el.dataset.interval) || 5000;
  setInterval(async () => {
    if (document.hidden) return;
    try {
      const r = await fetch(el.dataset.refresh, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (r.redirected) { window.location.assign("/admin/login"); return; }  // the session ended
      if (r.ok) el.innerHTML = await r.text();
    } catch (_) { /* the server is restarting: try again next time */ }
  }, every);
}
