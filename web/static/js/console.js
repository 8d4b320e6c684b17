// Shared helpers: every state-changing request carries the session's CSRF token.
"use strict";
const Console = (() => {
  const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

  async function api(method, url, body) {
    const opts = { method, headers: { "X-CSRF-Token": csrf(), "Accept": "application/json" }, credentials: "same-origin" };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const res = await fetch(url, opts);
    const text = await res.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (e) { data = { detail: text }; }
    if (!res.ok) throw new Error(errorMessage(data) || `${res.status} ${res.statusText}`);
    return data;
  }

  function errorMessage(data) {
    if (!data) return null;
    if (data.error && data.error.message) return data.error.message;
    if (typeof data.detail === "string") return data.detail;
    if (Array.isArray(data.detail)) return data.detail.map((d) => d.msg).join("; ");
    return null;
  }

  function flash(message, kind) {
    let box = document.getElementById("flash-js");
    if (!box) return alert(message);
    box.className = `flash ${kind || "ok"}`;
    box.textContent = message;
    box.hidden = false;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }

  const fmt = {
    int: (n) => (n === null || n === undefined) ? "–" : Math.round(n).toLocaleString("en-US"),
    num: (n, d = 1) => (n === null || n === undefined) ? "–" : Number(n).toFixed(d),
    ms: (s) => (s === null || s === undefined) ? "–" : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`,
    pct: (r) => (r === null || r === undefined) ? "–" : `${(r * 100).toFixed(1)}%`,
  };

  // Forms marked data-confirm ask before destructive posts.
  document.addEventListener("submit", (ev) => {
    const msg = ev.target.getAttribute("data-confirm");
    if (msg && !confirm(msg)) ev.preventDefault();
  });

  document.addEventListener("change", (ev) => {
    if (ev.target.matches("select[data-autosubmit]")) ev.target.form.submit();
  });

  // A tenant field (input[data-tenant-search]) offers the names that match what is typed so far, a few at a
  // time from the console's paged tenant search, instead of a list of every tenant; picking one shows it.
  const tenantSearch = { timer: null, seq: 0 };
  document.addEventListener("input", (ev) => {
    const field = ev.target;
    if (!field.matches("input[data-tenant-search]")) return;
    const list = document.getElementById(field.getAttribute("list"));
    const picked = !ev.inputType || ev.inputType === "insertReplacementText";
    if (picked && [...list.options].some((o) => o.value === field.value)) {
      field.form.requestSubmit();  // a name picked from the list (no keystroke): show that tenant
      return;
    }
    clearTimeout(tenantSearch.timer);
    tenantSearch.timer = setTimeout(async () => {
      const seq = ++tenantSearch.seq;
      const params = new URLSearchParams({ q: field.value.trim(), limit: field.dataset.limit || "20" });
      let page;
      try {
        page = await api("GET", `${field.dataset.tenantSearch}?${params}`);
      } catch (e) {
        return;  // the field still takes a typed name
      }
      if (seq !== tenantSearch.seq) return;  // an answer to an older prefix
      list.replaceChildren(...page.data.map((t) => el("option", { value: t.name })));
    }, 150);
  });

  return { api, flash, el, fmt, csrf };
})();
