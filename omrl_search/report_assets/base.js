/* omrl report, part 1 of 3: the embedded data, DOM helpers, number formats, colours and an SVG line
   chart. report.py inlines base.js, tree.js and sections.js, in that order, into one function. */

const DATA = JSON.parse(document.getElementById("report-data").textContent);
/** URL parameters, from the query or the hash: eval, strategy, budget, task, select, color. */
const PARAMS = new URLSearchParams(location.search.replace(/^\?/, "") + "&" + location.hash.replace(/^#/, ""));
const SVGNS = "http://www.w3.org/2000/svg"; // a name, not an address: nothing is fetched

// --- DOM -----------------------------------------------------------------------------------------
/** Set attributes (``on``: event handlers) and append children (nested arrays; null skipped). */
function put(el, attrs, kids) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid != null && kid !== false) el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}
const h = (tag, attrs, ...kids) => put(document.createElement(tag), attrs, kids);
const s = (tag, attrs, ...kids) => put(document.createElementNS(SVGNS, tag), attrs, kids);
const refill = (el, ...kids) => {
  el.replaceChildren();
  return put(el, {}, kids);
};

function select(options, value, onChange) {
  const el = h("select", {}, options.map(([v, label]) => h("option", { value: v, selected: String(v) === String(value) }, label)));
  el.addEventListener("change", () => onChange(el.value));
  return el;
}
const pick = (label, el) => h("label", { class: "pick" }, label, el);

// --- numbers and colours -------------------------------------------------------------------------
function fmt(x, digits) {
  if (x == null || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  const a = Math.abs(x);
  if (a >= 1e6) return (x / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(1).replace(/\.0$/, "") + "k";
  if (Number.isInteger(x)) return String(x);
  if (a >= 100) return x.toFixed(0);
  if (a >= 1) return x.toFixed(digits == null ? 2 : digits);
  return a === 0 ? "0" : String(+x.toPrecision(digits == null ? 3 : digits));
}
const clipText = (t, n) => (t && t.length > n ? t.slice(0, n - 1) + "…" : t || "");
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#9c755f", "#17a2b8", "#ff9da7", "#7f7f7f", "#bcbd22"];
const colours = new Map();
function colourOf(name) {
  if (!colours.has(name)) colours.set(name, PALETTE[colours.size % PALETTE.length]);
  return colours.get(name);
}
["react", "best_of_n", "beam", "tot", "got", "dfsdt", "mcts"].forEach(colourOf); // same colours in every report

// --- line charts ---------------------------------------------------------------------------------
function niceTicks(lo, hi, n) {
  const raw = (hi - lo || Math.abs(hi) || 1) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
  const step = (f >= 7.5 ? 10 : f >= 3.5 ? 5 : f >= 1.5 ? 2 : 1) * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}
function logTicks(lo, hi) {
  const d0 = Math.floor(Math.log10(lo)), d1 = Math.ceil(Math.log10(hi)), mults = d1 - d0 <= 2 ? [1, 2, 5] : [1];
  const out = [];
  for (let d = d0; d <= d1; d++) for (const m of mults) out.push(m * Math.pow(10, d));
  return out.filter((v) => v >= lo && v <= hi);
}
const tick = (v) => (Math.abs(v) >= 1e4 ? fmt(v) : String(+v.toPrecision(6)));

/** A figure with an SVG line chart; series = [{name, colour, dashed, markers, points: [{x, y, label, lo, hi}]}].
    x is on a log scale when ``logx`` and the points span a factor of 8 or more; ``xint``: whole-number ticks;
    a point with ``lo``/``hi`` gets an error bar (a success rate's 95% interval). */
function lineChart({ title, xlabel, ylabel, series, ymin, ymax, logx = true, xint = false, width = 460, height = 270 }) {
  const fig = h("figure", { class: "chart" }, h("figcaption", {}, title));
  const pts = series.flatMap((sr) => sr.points);
  if (!pts.length) return put(fig, {}, [h("p", { class: "muted" }, "no data")]);
  const m = { l: 48, r: 12, t: 8, b: 38 }, W = width - m.l - m.r, H = height - m.t - m.b;
  const xs = pts.map((p) => p.x), ys = pts.map((p) => p.y);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = ymin ?? Math.min(...ys), y1 = ymax ?? Math.max(...ys);
  const log = logx && x0 > 0 && x1 / x0 >= 8;
  if (log) [x0, x1] = [x0 / 1.3, x1 * 1.3];
  else {
    const pad = (x1 - x0) * 0.06 || Math.abs(x0) * 0.1 || 1;
    [x0, x1] = [x0 >= 0 ? Math.max(0, x0 - pad) : x0 - pad, x1 + pad];
  }
  if (y0 === y1) [y0, y1] = [y0 - 0.5, y1 + 0.5];
  else if (ymin == null) [y0, y1] = [y0 - (y1 - y0) * 0.06, y1 + (y1 - y0) * 0.06];
  const X = log ? (v) => m.l + (Math.log(v / x0) / Math.log(x1 / x0)) * W : (v) => m.l + ((v - x0) / (x1 - x0)) * W;
  const Y = (v) => m.t + H - ((v - y0) / (y1 - y0)) * H;
  const xt = (log ? logTicks(x0, x1) : niceTicks(x0, x1, 6)).filter((v) => !xint || Number.isInteger(v));
  const yt = niceTicks(y0, y1, 5);
  const svg = s("svg", { class: "plot", viewBox: `0 0 ${width} ${height}`, role: "img" },
    s("g", { class: "grid" },
      xt.map((v) => s("line", { x1: X(v), x2: X(v), y1: m.t, y2: m.t + H })),
      yt.map((v) => s("line", { x1: m.l, x2: m.l + W, y1: Y(v), y2: Y(v) }))),
    s("g", { class: "axis" },
      s("path", { d: `M${m.l},${m.t}V${m.t + H}H${m.l + W}`, fill: "none" }),
      xt.map((v) => s("text", { x: X(v), y: m.t + H + 14, "text-anchor": "middle" }, tick(v))),
      yt.map((v) => s("text", { x: m.l - 6, y: Y(v) + 3.5, "text-anchor": "end" }, tick(v)))),
    s("text", { class: "axis-label", x: m.l + W / 2, y: height - 4, "text-anchor": "middle" }, xlabel + (log ? " (log)" : "")),
    s("text", { class: "axis-label", transform: `translate(11,${m.t + H / 2}) rotate(-90)`, "text-anchor": "middle" }, ylabel));
  for (const sr of series) {
    const p = sr.points.slice().sort((a, b) => a.x - b.x);
    if (!p.length) continue;
    const d = p.map((q, i) => (i ? "L" : "M") + X(q.x).toFixed(1) + "," + Y(q.y).toFixed(1)).join("");
    svg.append(s("path", { class: "series" + (sr.dashed ? " dashed" : ""), stroke: sr.colour, "data-name": sr.name, d }));
    if (p.length > 60 || sr.markers === false) continue; // no markers on long curves
    for (const q of p) {
      const ci = q.lo != null && q.hi != null;
      const tip = `${sr.name}${q.label ? " @ " + q.label : ""}: ${fmt(q.y, 3)}${ci ? ` [${fmt(q.lo, 2)}, ${fmt(q.hi, 2)}]` : ""} at ${fmt(q.x)}`;
      if (ci) {
        const x = X(q.x).toFixed(1), y0 = Y(q.lo).toFixed(1), y1 = Y(q.hi).toFixed(1);
        svg.append(s("path", { class: "errbar", stroke: sr.colour, d: `M${x},${y0}V${y1}M${+x - 3},${y0}h6M${+x - 3},${y1}h6` }));
      }
      svg.append(s("circle", { class: "pt", cx: X(q.x), cy: Y(q.y), r: 3.6, fill: sr.colour }, s("title", {}, tip)));
    }
  }
  fig.append(svg);
  if (series.length > 1 || series[0].name) {
    fig.append(h("div", { class: "legend" }, series.map((sr) =>
      h("span", {}, h("span", { class: "sw" + (sr.dashed ? " dashed" : ""), style: `background:${sr.colour}` }), sr.name))));
  }
  return fig;
}
