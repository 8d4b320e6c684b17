// Small SVG charts: stacked bars (per day / per adapter). No library, no network.
"use strict";
const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const svgEl = (tag, attrs) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    return n;
  };

  // A top value whose quarter is a round number, so the four grid lines read 0, 25, 50, 75, 100 and the like.
  function niceMax(v) {
    if (v <= 0) return 4;
    const quarter = v / 4;
    const p = Math.pow(10, Math.floor(Math.log10(quarter)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= quarter) return 4 * Math.max(1, m * p);
    return 40 * p;
  }

  function short(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + "k";
    return String(Math.round(n));
  }

  // rows: [{label, values: [a, b, ...]}], series: [{name, cls}]
  function stackedBars(container, rows, series, opts = {}) {
    container.innerHTML = "";
    if (!rows.length) {
      container.append(Object.assign(document.createElement("div"), { className: "empty", textContent: "No data in this range." }));
      return;
    }
    const width = container.clientWidth || 600, height = opts.height || 220;
    const pad = { l: 48, r: 8, t: 8, b: opts.rotate ? 64 : 28 };
    const svg = svgEl("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": opts.title || "chart" });
    const max = niceMax(Math.max(...rows.map((r) => r.values.reduce((a, b) => a + b, 0))));
    const plotH = height - pad.t - pad.b, plotW = width - pad.l - pad.r;
    for (let i = 0; i <= 4; i++) {
      const y = pad.t + plotH - (plotH * i) / 4;
      svg.append(svgEl("line", { x1: pad.l, x2: width - pad.r, y1: y, y2: y, stroke: "#e9ecf2" }));
      const t = svgEl("text", { x: pad.l - 6, y: y + 4, "text-anchor": "end" });
      t.textContent = short((max * i) / 4);
      svg.append(t);
    }
    const slot = plotW / rows.length, barW = Math.max(2, Math.min(48, slot * 0.7));
    const labelEvery = Math.ceil(rows.length / Math.max(1, Math.floor(plotW / (opts.rotate ? 18 : 70))));
    rows.forEach((row, i) => {
      let y = pad.t + plotH;
      const x = pad.l + i * slot + (slot - barW) / 2;
      row.values.forEach((v, s) => {
        const h = (plotH * v) / max;
        y -= h;
        const rect = svgEl("rect", { x, y, width: barW, height: Math.max(0, h), class: `bar ${series[s].cls}` });
        const tip = svgEl("title", {});
        tip.textContent = `${row.label} · ${series[s].name}: ${v.toLocaleString("en-US")}`;
        rect.append(tip);
        svg.append(rect);
      });
      if (i % labelEvery === 0) {
        const lx = x + barW / 2, ly = height - pad.b + 14;
        const t = svgEl("text", opts.rotate
          ? { x: lx, y: ly, "text-anchor": "end", transform: `rotate(-35 ${lx} ${ly})` }
          : { x: lx, y: ly, "text-anchor": "middle" });
        t.textContent = row.label.length > 22 ? row.label.slice(0, 21) + "…" : row.label;
        svg.append(t);
      }
    });
    container.append(svg);
  }

  function sparkline(container, values, opts = {}) {
    container.innerHTML = "";
    if (values.length < 2) {
      container.append(Object.assign(document.createElement("div"), { className: "empty", textContent: "collecting…" }));
      return;
    }
    const width = container.clientWidth || 200, height = opts.height || 56;
    const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", height });
    const max = Math.max(1e-9, ...values) * 1.25;  // headroom: a steady rate sits below the top edge
    svg.append(svgEl("line", { x1: 0, x2: width, y1: height - 1, y2: height - 1, stroke: "#dfe3ea" }));
    const pts = values.map((v, i) => `${(i * width) / (values.length - 1)},${height - 2 - ((height - 4) * v) / max}`);
    svg.append(svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: "#3b5bdb", "stroke-width": 1.8 }));
    container.append(svg);
  }

  return { stackedBars, sparkline, short };
})();
