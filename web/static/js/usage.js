// Usage page charts, drawn from JSON embedded in the page by the server.
"use strict";
(() => {
  const dataNode = document.getElementById("usage-data");
  if (!dataNode) return;
  const data = JSON.parse(dataNode.textContent);
  const series = [{ name: "prompt tokens", cls: "bar-prompt" }, { name: "completion tokens", cls: "bar-completion" }];
  const draw = () => {
    Charts.stackedBars(document.getElementById("chart-days"),
      data.by_day.map((r) => ({ label: r.day.slice(5), values: [r.prompt_tokens, r.completion_tokens] })), series,
      { title: "tokens per day" });
    Charts.stackedBars(document.getElementById("chart-adapters"),
      data.by_adapter.map((r) => ({ label: r.adapter || "base model", values: [r.prompt_tokens, r.completion_tokens] })), series,
      { title: "tokens per adapter", rotate: data.by_adapter.length > 6 });
  };
  draw();
  window.addEventListener("resize", () => { clearTimeout(window.__usageT); window.__usageT = setTimeout(draw, 150); });
})();
