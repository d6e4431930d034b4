// forensics timeline: draws the run page's lanes and markers as SVG from the JSON block #timeline-data.
// Hand-written, no library: every string from the run goes into the page through textContent or setAttribute,
// never as markup. Data are min/max buckets; each drawing re-buckets them to one column per pixel.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const data = JSON.parse(document.getElementById("timeline-data").textContent);
  const LANES = [
    ["loss", "loss", true],
    ["grad_norm", "gradient norm", true],
    ["lr", "learning rate", false],
    ["loss_scale", "loss scale", true],
  ];
  const MARK = {
    nonfinite: ["#d62728", "non-finite"],
    spike_dumped: ["#ff7f0e", "spike, dumped"],
    spike_not_dumped: ["#ffbb78", "spike, not dumped"],
    precursor: ["#9467bd", "precursor"],
    exception: ["#8c564b", "exception"],
    dump: ["#1f77b4", "dump"],
  };
  const LEFT = 78, RIGHT = 16, LANE_H = 120, RAIL_H = 70;
  const ROW = { nonfinite: 10, exception: 10, spike_dumped: 25, spike_not_dumped: 25, precursor: 40, dump: 55 };
  const state = { from: data.first, to: data.last, hidden: new Set(), log: true };
  const lanes = LANES.filter(([key]) => data.ranks.some((r) => r.lanes[key] && r.lanes[key].some((v) => v !== null)));
  const root = document.getElementById("chart");
  const tip = document.getElementById("tip");

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }
  function text(parent, x, y, words, attrs) {
    const t = el("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = words;
    return t;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }
  function width() { return Math.max(480, (root.clientWidth || 1200) - 20); }

  // one column per pixel: [min, max] of each rank's buckets that fall in it
  function columns(rank, key, x, plotW) {
    const lo = rank.lanes[key + "_lo"] || rank.lanes[key], hi = rank.lanes[key];
    const cols = new Map();
    for (let i = 0; i < rank.x0.length; i++) {
      const a = rank.x0[i], b = rank.x1[i];
      if (b < state.from || a > state.to || hi[i] === null) continue;
      const c = Math.max(0, Math.min(plotW - 1, Math.floor(x(a))));
      const seen = cols.get(c);
      if (seen) { seen[0] = Math.min(seen[0], lo[i]); seen[1] = Math.max(seen[1], hi[i]); }
      else cols.set(c, [lo[i], hi[i]]);
    }
    return cols;
  }

  function draw() {
    root.textContent = "";
    const W = width(), plotW = W - LEFT - RIGHT, span = Math.max(1, state.to - state.from);
    const x = (s) => ((s - state.from) / span) * plotW;
    const visible = data.ranks.filter((r) => !state.hidden.has(r.rank));
    const markers = data.markers.filter((m) => m.step >= state.from && m.step <= state.to &&
      m.ranks.some((r) => !state.hidden.has(r)));
    const H = RAIL_H + lanes.length * LANE_H + 28;
    const svg = el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" }, root);
    svg.setAttribute("aria-label", "run timeline");
    const plot = el("g", { transform: `translate(${LEFT},0)` }, svg);
    // the marker rail
    text(svg, 6, 14, "faults", { class: "rail-label" });
    text(svg, 6, 29, "spikes", { class: "rail-label" });
    text(svg, 6, 44, "precursors", { class: "rail-label" });
    text(svg, 6, 59, "dumps", { class: "rail-label" });
    el("line", { x1: 0, x2: plotW, y1: RAIL_H - 6, y2: RAIL_H - 6, class: "axis" }, plot);
    for (const m of markers) {
      const [color, words] = MARK[m.kind];
      const cx = x(m.step);
      el("line", { x1: cx, x2: cx, y1: RAIL_H - 6, y2: RAIL_H + lanes.length * LANE_H, stroke: color,
        "stroke-dasharray": m.kind === "dump" ? "" : "3,3", "stroke-opacity": 0.55, class: "marker-line" }, plot);
      const g = el("g", { class: "marker", tabindex: 0, "data-kind": m.kind, "data-step": m.step,
        "data-ranks": m.ranks.join(","), "data-id": m.id }, plot);
      const y = ROW[m.kind];
      if (m.kind === "dump") {
        el("rect", { x: cx - 6, y: y - 6, width: 12, height: 12, rx: 2, fill: m.verdict ? color : "#fff",
          stroke: color, "stroke-width": 2 }, g);
      } else if (m.kind === "precursor") {
        el("path", { d: `M${cx},${y - 6}L${cx + 6},${y}L${cx},${y + 6}L${cx - 6},${y}Z`, fill: m.dumped ? color : "#fff", stroke: color, "stroke-width": 1.5 }, g);
      } else if (m.kind === "nonfinite") {
        el("circle", { cx: cx, cy: y, r: 6, fill: color }, g);
      } else if (m.kind === "exception") {
        el("rect", { x: cx - 6, y: y - 6, width: 12, height: 12, fill: color }, g);
      } else {
        el("path", { d: `M${cx},${y - 6}L${cx + 6},${y + 5}L${cx - 6},${y + 5}Z`, fill: m.dumped ? color : "#fff",
          stroke: MARK.spike_dumped[0], "stroke-width": 1.5 }, g);
      }
      const title = el("title", {}, g);
      title.textContent = `${words} at step ${m.step}: ${m.message}`;
      g.addEventListener("click", () => show(m));
      g.addEventListener("keydown", (e) => { if (e.key === "Enter") show(m); });
    }
    // the lanes
    lanes.forEach(([key, label, canLog], n) => {
      const top = RAIL_H + n * LANE_H, h = LANE_H - 22;
      const g = el("g", { transform: `translate(0,${top})`, class: "lane", "data-lane": key }, plot);
      el("rect", { x: 0, y: 0, width: plotW, height: h, class: "lane-bg" }, g);
      text(g, 8, 14, label, { class: "lane-label" });
      const percols = visible.map((r) => [r, columns(r, key, x, plotW)]);
      let lo = Infinity, hi = -Infinity;
      const useLog = state.log && canLog;
      for (const [, cols] of percols) for (const [a, b] of cols.values()) {
        if (useLog) { if (b > 0) { hi = Math.max(hi, b); lo = Math.min(lo, a > 0 ? a : b); } }
        else { lo = Math.min(lo, a); hi = Math.max(hi, b); }
      }
      if (!isFinite(lo)) { text(g, plotW / 2, h / 2, "no finite value here", { class: "empty" }); return; }
      if (useLog) { lo = Math.log10(lo); hi = Math.log10(hi); }
      if (hi - lo < 1e-12) { hi += useLog ? 0.5 : Math.abs(hi) * 0.05 + 1e-12; lo -= useLog ? 0.5 : Math.abs(lo) * 0.05 + 1e-12; }
      const pad = (hi - lo) * 0.06; lo -= pad; hi += pad;
      const y = (v) => { const t = useLog ? Math.log10(Math.max(v, 1e-300)) : v; return h - ((t - lo) / (hi - lo)) * h; };
      for (const frac of [0, 0.5, 1]) {
        const t = lo + (hi - lo) * frac, yy = h - frac * h;
        el("line", { x1: 0, x2: plotW, y1: yy, y2: yy, class: "grid" }, g);
        text(svg, LEFT - 6, top + yy + 4, fmt(useLog ? Math.pow(10, t) : t), { class: "tick", "text-anchor": "end" });
      }
      for (const [r, cols] of percols) {
        let d = "";
        for (const c of [...cols.keys()].sort((a, b) => a - b)) {
          const [a, b] = cols.get(c);
          if (useLog && b <= 0) continue;
          const y1 = y(b), y2 = y(useLog && a <= 0 ? b : a);
          d += `${d ? "L" : "M"}${c},${y1.toFixed(1)}` + (Math.abs(y2 - y1) > 0.5 ? `L${c},${y2.toFixed(1)}` : "");
        }
        el("path", { d: d, fill: "none", stroke: r.color, "stroke-width": 1.3, "stroke-opacity": 0.9,
          "data-rank": r.rank, class: "series" }, g);
      }
      brush(g, plotW, h, x);
    });
    // the step axis
    const ay = RAIL_H + lanes.length * LANE_H - 18;
    const raw = span / 8, mag = Math.pow(10, Math.floor(Math.log10(raw))), unit = [1, 2, 5, 10].map((k) => k * mag).find((k) => k >= raw) || raw;
    for (let s = Math.ceil(state.from / unit) * unit; s <= state.to; s += unit) {
      el("line", { x1: x(s), x2: x(s), y1: ay, y2: ay + 4, class: "axis" }, plot);
      text(plot, x(s), ay + 15, String(Math.round(s)), { class: "tick", "text-anchor": "middle" });
    }
    text(svg, 6, ay + 15, "step", { class: "lane-label" });
    document.getElementById("range").textContent = `steps ${Math.round(state.from)} to ${Math.round(state.to)}`;
    document.getElementById("from").value = Math.round(state.from);
    document.getElementById("to").value = Math.round(state.to);
  }

  // drag across a lane to zoom to the steps under it
  function brush(g, plotW, h, x) {
    const sel = el("rect", { x: 0, y: 0, width: 0, height: h, class: "brush", visibility: "hidden" }, g);
    const area = el("rect", { x: 0, y: 0, width: plotW, height: h, fill: "transparent", class: "drag" }, g);
    let start = null;
    const at = (e) => Math.max(0, Math.min(plotW, e.clientX - area.getBoundingClientRect().left));
    area.addEventListener("mousedown", (e) => { start = at(e); sel.setAttribute("visibility", "visible"); });
    area.addEventListener("mousemove", (e) => {
      const px = at(e), step = state.from + (px / plotW) * (state.to - state.from);
      tip.textContent = `step ${Math.round(step)}` + readout(Math.round(step));
      tip.style.left = `${e.pageX + 12}px`; tip.style.top = `${e.pageY + 12}px`; tip.hidden = false;
      if (start === null) return;
      sel.setAttribute("x", Math.min(start, px)); sel.setAttribute("width", Math.abs(px - start));
    });
    area.addEventListener("mouseleave", () => { tip.hidden = true; });
    area.addEventListener("mouseup", (e) => {
      const px = at(e);
      if (start !== null && Math.abs(px - start) > 4) {
        const a = Math.min(start, px), b = Math.max(start, px), span = state.to - state.from;
        zoom(state.from + (a / plotW) * span, state.from + (b / plotW) * span);
      } else sel.setAttribute("visibility", "hidden");
      start = null;
    });
  }

  // the values each shown rank logged at (the bucket holding) a step
  function readout(step) {
    let out = "";
    for (const r of data.ranks) {
      if (state.hidden.has(r.rank)) continue;
      let i = r.x0.findIndex((a, j) => a <= step && step <= r.x1[j]);
      if (i < 0) continue;
      out += `\nrank ${r.rank}: loss ${fmt(r.lanes.loss ? r.lanes.loss[i] : null)}, grad norm ${fmt(r.lanes.grad_norm ? r.lanes.grad_norm[i] : null)}`;
    }
    return out;
  }

  function zoom(a, b) {
    state.from = Math.max(data.first, Math.floor(a));
    state.to = Math.min(data.last, Math.ceil(b));
    if (state.to <= state.from) state.to = state.from + 1;
    draw();
  }

  function show(m) {
    const box = document.getElementById("detail");
    box.textContent = "";
    const head = document.createElement("strong");
    head.textContent = `${MARK[m.kind][1]} at step ${m.step}`;
    box.appendChild(head);
    const lines = [m.message, `seen first by rank ${m.first_ranks.join(", ")} (of ranks ${m.ranks.join(", ")})`];
    if (m.kind !== "dump") lines.push(m.dumped ? "dumped" : `not dumped: ${m.why_not || "?"}`);
    if (m.verdict) lines.push(`verdict: ${m.verdict} — ${m.headline || ""}`);
    for (const line of lines) { const p = document.createElement("div"); p.textContent = line; box.appendChild(p); }
    if (m.report) {
      const a = document.createElement("a");
      a.setAttribute("href", m.report);
      a.textContent = "open the replay report";
      box.appendChild(a);
    }
    const z = document.createElement("button");
    z.textContent = "zoom here";
    z.addEventListener("click", () => zoom(m.step - 150, m.step + 50));
    box.appendChild(z);
  }

  // controls: ranks, log scale, step range
  const ranksBox = document.getElementById("ranks");
  for (const r of data.ranks) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox"; box.checked = true;
    box.addEventListener("change", () => { box.checked ? state.hidden.delete(r.rank) : state.hidden.add(r.rank); draw(); });
    const swatch = document.createElement("span");
    swatch.className = "swatch"; swatch.style.background = r.color;
    label.append(box, swatch, document.createTextNode(`rank ${r.rank}`));
    ranksBox.appendChild(label);
  }
  document.getElementById("log").addEventListener("change", (e) => { state.log = e.target.checked; draw(); });
  document.getElementById("reset").addEventListener("click", () => zoom(data.first, data.last));
  document.getElementById("apply").addEventListener("click", () =>
    zoom(Number(document.getElementById("from").value), Number(document.getElementById("to").value)));
  for (const row of document.querySelectorAll("tr[data-step]")) {
    row.addEventListener("click", () => { const s = Number(row.dataset.step); zoom(s - 150, s + 50); });
  }
  window.addEventListener("resize", draw);
  draw();
  document.body.setAttribute("data-rendered", String(document.querySelectorAll("#chart g.marker").length));
})();
