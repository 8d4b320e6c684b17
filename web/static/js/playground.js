// Playground: chat with a tenant's adapter or the base model; tokens stream in over SSE as they arrive.
"use strict";
(() => {
  const form = document.getElementById("play-form");
  if (!form) return;
  const log = document.getElementById("chat-log");
  const input = document.getElementById("play-input");
  const tenantSel = document.getElementById("play-tenant");
  const modelSel = document.getElementById("play-model");
  const send = document.getElementById("play-send");
  let messages = [];

  async function loadModels() {
    modelSel.innerHTML = "";
    if (!tenantSel.value) return;
    const data = await Console.api("GET", `${form.dataset.models}?tenant_id=${encodeURIComponent(tenantSel.value)}`);
    for (const m of data.models) modelSel.append(Console.el("option", { value: m.id, text: m.label }));
  }

  function bubble(role, text) {
    const node = Console.el("div", { class: `msg ${role}` }, text);
    log.append(node);
    log.scrollTop = log.scrollHeight;
    return node;
  }

  async function ask(ev) {
    ev.preventDefault();
    const content = input.value.trim();
    if (!content || !tenantSel.value || !modelSel.value) return;
    messages.push({ role: "user", content });
    bubble("user", content);
    input.value = "";
    send.disabled = true;
    const out = bubble("assistant", "");
    const started = performance.now();
    let firstAt = null, text = "", usage = null;
    try {
      const res = await fetch(form.action, {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": Console.csrf(), Accept: "text/event-stream" },
        body: JSON.stringify({
          tenant_id: tenantSel.value, model: modelSel.value, messages,
          max_tokens: Number(document.getElementById("play-max").value || 64),
          temperature: Number(document.getElementById("play-temp").value || 0),
        }),
      });
      if (!res.ok) {
        let msg = `${res.status}`;
        try { const b = await res.json(); msg = (b.error && b.error.message) || b.detail || msg; } catch (e) { /* keep status */ }
        throw new Error(msg);
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const payload = line.slice(6);
            if (payload === "[DONE]") continue;
            const chunk = JSON.parse(payload);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.usage) usage = chunk.usage;
            for (const c of chunk.choices || []) {
              const delta = (c.delta && c.delta.content) || "";
              if (delta && firstAt === null) firstAt = performance.now();
              text += delta;
            }
            out.textContent = text;
            log.scrollTop = log.scrollHeight;
          }
        }
      }
      messages.push({ role: "assistant", content: text });
      const meta = [];
      if (firstAt !== null) meta.push(`first token ${Math.round(firstAt - started)} ms`);
      meta.push(`total ${Math.round(performance.now() - started)} ms`);
      if (usage) meta.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
      out.append(Console.el("span", { class: "meta", text: meta.join(" · ") }));
    } catch (e) {
      out.className = "msg error";
      out.textContent = `Error: ${e.message}`;
      messages.pop();
    } finally {
      send.disabled = false;
      input.focus();
    }
  }

  tenantSel.addEventListener("change", () => { messages = []; log.innerHTML = ""; loadModels(); });
  document.getElementById("play-reset").addEventListener("click", () => { messages = []; log.innerHTML = ""; });
  form.addEventListener("submit", ask);
  input.addEventListener("keydown", (ev) => { if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); form.requestSubmit(); } });
  loadModels();
})();
