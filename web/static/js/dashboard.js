// Live dashboard: polls the console's JSON endpoint and updates in place, no reload.
"use strict";
(() => {
  const root = document.getElementById("dashboard");
  if (!root) return;
  const { fmt } = Console;
  const history = { tokens: [], requests: [] };
  const set = (id, text) => { const n = document.getElementById(id); if (n) n.textContent = text; };
  const meter = (id, ratio) => { const n = document.getElementById(id); if (n) n.style.width = `${Math.min(100, (ratio || 0) * 100)}%`; };

  // Unpin posts the adapters page's own form (CSRF token included) and comes back to the dashboard.
  function unpinForm(a) {
    const label = `Unpin ${a.name} of ${a.tenant}`;
    return Console.el("form", { method: "post", action: `/console/tenants/${a.tenant_id}/versions/${a.version_id}/prefetch`, class: "inline" },
      Console.el("input", { type: "hidden", name: "csrf_token", value: Console.csrf() }),
      Console.el("input", { type: "hidden", name: "pin", value: "0" }),
      Console.el("input", { type: "hidden", name: "back", value: "dashboard" }),
      Console.el("button", { type: "submit", class: "secondary small", "aria-label": label, text: "Unpin" }));
  }

  let shownAdapters = null;
  function renderAdapters(rows) {
    const body = document.getElementById("resident-body");
    const key = JSON.stringify(rows);
    if (key === shownAdapters) return;  // rebuilt only when it changed: a button is not swapped under the pointer
    shownAdapters = key;
    body.innerHTML = "";
    if (!rows.length) {
      body.append(Console.el("tr", {}, Console.el("td", { colspan: 5, class: "empty", text: "No adapter is cached." })));
      return;
    }
    for (const a of rows) {
      const pin = a.pinned
        ? [Console.el("span", { class: "badge pinned", text: "pinned" }), " ", unpinForm(a)]
        : a.engine_pinned
          ? [Console.el("span", { class: "badge pinned", title: "the engine holds these weights pinned for another version's pin", text: "pinned (shared)" })]
          : [Console.el("span", { class: "muted", text: "–" })];
      body.append(Console.el("tr", {},
        Console.el("td", { text: a.name || "(unknown)" }),
        Console.el("td", { text: a.tenant || "–" }),
        Console.el("td", {}, Console.el("span", { class: `badge ${a.where === "device" ? "ready" : ""}`, text: a.where })),
        Console.el("td", { class: "mono", text: a.content_hash.slice(0, 12) }),
        Console.el("td", { class: "nowrap" }, ...pin)));
    }
  }

  async function refresh() {
    let d;
    try {
      const res = await fetch(root.dataset.src, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (res.status === 401) {  // the session ended (logout elsewhere, expiry): back to the sign-in page
        window.location.assign(`/console/login?next=${encodeURIComponent(window.location.pathname)}`);
        return;
      }
      if (!res.ok) throw new Error(`${res.status}`);
      d = await res.json();
    } catch (e) {
      set("dash-status", "disconnected");
      return;
    }
    const w = d.window, e = d.engine;
    set("dash-status", `updated ${new Date().toLocaleTimeString()}`);
    set("m-live", e.available ? fmt.int(e.running + e.waiting) : "–");
    set("m-live-hint", e.available ? `${e.running} running · ${e.waiting} waiting` : "engine not attached");
    set("m-tps", fmt.num(w.tokens_per_s, 1));
    set("m-rps", `${fmt.num(w.requests_per_s, 2)} req/s over ${w.window_s}s`);
    set("m-ttft", `${fmt.ms(w.ttft_p50_s)} / ${fmt.ms(w.ttft_p95_s)}`);
    set("m-tpot", `${fmt.ms(w.tpot_p50_s)} / ${fmt.ms(w.tpot_p95_s)}`);
    set("m-queue", e.available ? fmt.int(e.waiting) : "–");
    set("m-kv", e.available ? fmt.pct(e.kv_usage) : "–");
    set("m-kv-hint", e.available ? `${fmt.int(e.kv_blocks_used)} of ${fmt.int(e.kv_blocks_total)} blocks` : "");
    meter("m-kv-meter", e.available ? e.kv_usage : 0);
    set("m-slots", e.available ? `${e.lora_slots_used} / ${e.lora_slots_total}` : "–");
    meter("m-slots-meter", e.available && e.lora_slots_total ? e.lora_slots_used / e.lora_slots_total : 0);
    set("m-host", e.available ? fmt.int(e.lora_host_cached.length) : "–");
    set("m-hit", e.available ? fmt.pct(e.lora_hit_rate) : "–");
    set("m-loads", e.available ? `${fmt.int(e.lora_loads_total)} loads · ${fmt.int(e.lora_evictions_total)} evictions` : "");
    set("m-prefix", e.available ? fmt.pct(e.prefix_cache_hit_rate) : "–");
    history.tokens.push(w.tokens_per_s);
    history.requests.push(w.requests_per_s);
    if (history.tokens.length > 90) { history.tokens.shift(); history.requests.shift(); }
    Charts.sparkline(document.getElementById("spark-tokens"), history.tokens);
    renderAdapters(d.adapters || []);
  }

  refresh();
  setInterval(refresh, Number(root.dataset.interval || 2000));
})();
