/* omrl report, part 2 of 3: the search-tree viewer. Pick a result set, strategy, budget and task;
   the tree is laid out tidily (first-parent edges), merge edges (Graph-of-Thoughts aggregation) are
   drawn as dashed arcs, nodes are coloured by a score, the chosen path is highlighted, and a click
   shows a node's thought, action, observation and scores. */

/** Tidy layout (contours, Reingold-Tilford style): sibling subtrees side by side as close as their
    contours allow, each parent centred over its first and last child. x in units of the node gap. */
function tidy(rootId, kids) {
  const rel = new Map(); // node -> x offset from its parent
  function place(v) { // returns the subtree's left and right contours, one entry per level
    const ch = kids.get(v) || [];
    if (!ch.length) return { l: [0], r: [0] };
    const cs = ch.map(place), off = [0], L = cs[0].l.slice(), R = cs[0].r.slice();
    for (let i = 1; i < cs.length; i++) {
      const c = cs[i];
      let shift = -Infinity;
      for (let d = 0; d < Math.min(R.length, c.l.length); d++) shift = Math.max(shift, R[d] - c.l[d] + 1);
      off.push(shift);
      for (let d = 0; d < c.r.length; d++) {
        R[d] = c.r[d] + shift;
        if (d >= L.length) L[d] = c.l[d] + shift;
      }
    }
    const mid = (off[0] + off[off.length - 1]) / 2;
    ch.forEach((c, i) => rel.set(c, off[i] - mid));
    return { l: [0, ...L.map((x) => x - mid)], r: [0, ...R.map((x) => x - mid)] };
  }
  const contour = place(rootId), x = new Map([[rootId, 0]]), stack = [rootId];
  while (stack.length) {
    const v = stack.pop();
    for (const c of kids.get(v) || []) {
      x.set(c, x.get(v) + rel.get(c));
      stack.push(c);
    }
  }
  const left = Math.min(...contour.l);
  for (const [k, v] of x) x.set(k, v - left);
  return x;
}

const METRICS = {
  score: ["score (reward model / PRM)", (n) => n.s], value: ["value Q (MCTS)", (n) => n.q],
  prior: ["prior", (n) => n.pr], reward: ["env reward", (n) => n.r], visits: ["visits", (n) => n.n || null],
  none: ["status only", () => null],
};
const RAMP = [[215, 48, 39], [252, 141, 89], [254, 224, 139], [145, 207, 96], [26, 152, 80]]; // low red, high green
function rampColour(t) {
  const f = Math.max(0, Math.min(1, t)) * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(f)), u = f - i;
  return "rgb(" + RAMP[i].map((c, j) => Math.round(c + (RAMP[i + 1][j] - c) * u)).join(",") + ")";
}
const evalName = (e) => e.id || DATA.title;
/** The index of the last bench result set in [[index, eval]] (a loop's latest evaluation), else the last. */
const lastBench = (pairs) => (pairs.filter(([, e]) => e.kind === "bench").pop() || pairs[pairs.length - 1])[0];

/** The viewer's section, appended to ``parent`` before it draws (the pane needs its size). */
function treeSection(parent) {
  const sets = DATA.evals.map((e, i) => [i, e]).filter(([, e]) => e.trees.some((g) => g.results.length));
  const st = { ev: null, strategy: null, budget: null, task: 0, colour: PARAMS.get("color"), auto: false, labels: null };
  let cur = null, view = null; // the tree shown (result, nodes by id, children, chosen path) and its pan/zoom

  const groups = () => DATA.evals[st.ev].trees.filter((g) => g.results.length);
  const group = () => groups().find((g) => g.strategy === st.strategy && g.budget === st.budget);
  const meanNodes = (g) => g.results.reduce((n, r) => n + r.nodes.length, 0) / g.results.length;
  const coloured = (g) => g.results.some((r) => r.nodes.some((n) => n.s != null || n.q != null));
  function chooseGroup(strategy, budget) { // the one asked for, else trees with scores first, biggest first
    const rank = (g) => meanNodes(g) + (coloured(g) ? 1e9 : 0);
    const top = (gs) => gs.reduce((a, b) => (rank(b) > rank(a) ? b : a));
    const same = groups().filter((x) => x.strategy === strategy);
    const g = same.find((x) => x.budget === budget) || (same.length ? top(same) : top(groups()));
    [st.strategy, st.budget] = [g.strategy, g.budget];
    st.task = Math.min(st.task, g.results.length - 1);
  }
  st.ev = (sets.find(([, e]) => e.id === PARAMS.get("eval")) || [lastBench(sets)])[0];
  chooseGroup(PARAMS.get("strategy"), PARAMS.get("budget"));
  const wantTask = PARAMS.get("task");
  if (wantTask != null) {
    const i = group().results.findIndex((r) => r.task_id === wantTask);
    st.task = i >= 0 ? i : Math.max(0, Math.min(group().results.length - 1, +wantTask || 0));
  }
  st.selected = PARAMS.get("select") ? +PARAMS.get("select") : null;

  const toolbar = h("div", { class: "toolbar" }), taskline = h("div", { class: "taskline" });
  const pane = h("div", { class: "treepane" }), details = h("div", { id: "details" });
  parent.append(h("section", { class: "card", id: "trees" },
    h("h2", {}, "Search trees", h("span", { class: "sub" },
      "click a node for its thought, action, observation and scores; drag to pan, wheel to zoom")),
    toolbar, taskline, h("div", { class: "treebox" }, pane, details)));

  const fresh = (fn) => (v) => { fn(v); st.selected = null; showTree(); };
  const taskLabel = (r) => `${r.success ? "✓" : "✗"} ${r.task_id} (${r.nodes.length} nodes)`;
  function showTree() {
    const r = group().results[st.task], spent = r.spent || {};
    if (st.auto || !(st.colour in METRICS)) { // the first metric this tree has
      st.auto = true;
      st.colour = r.nodes.some((n) => n.s != null) ? "score" : r.nodes.some((n) => n.q != null) ? "value" : "none";
    }
    const strategies = [...new Set(groups().map((g) => g.strategy))];
    const budgets = groups().filter((g) => g.strategy === st.strategy).map((g) => g.budget);
    refill(toolbar,
      sets.length > 1 && pick("results", select(sets.map(([i, e]) => [i, evalName(e)]), st.ev,
        fresh((v) => { st.ev = +v; chooseGroup(st.strategy, st.budget); }))),
      pick("strategy", select(strategies.map((x) => [x, x]), st.strategy, fresh((v) => chooseGroup(v, st.budget)))),
      (budgets.length > 1 || budgets[0] !== "") && pick("budget", select(budgets.map((b) => [b, b]), st.budget,
        fresh((v) => chooseGroup(st.strategy, v)))),
      pick("task", select(group().results.map((x, i) => [i, taskLabel(x)]), st.task, fresh((v) => { st.task = +v; }))),
      pick("colour by", select(Object.entries(METRICS).map(([k, [label]]) => [k, label]), st.colour,
        (v) => { [st.colour, st.auto] = [v, false]; draw(false); })),
      h("span", { class: "spacer" }),
      h("span", { class: "muted" }, `trees of ${group().results.length} of ${group().total} tasks`));
    const tokens = (spent.prompt_tokens || 0) + (spent.completion_tokens || 0);
    refill(taskline,
      h("span", { class: "badge " + (r.success ? "ok" : "bad") }, r.success ? "solved" : "not solved"),
      h("span", { class: "instr" }, r.instruction || r.task_id),
      h("span", { class: "muted" }, [`${r.nodes.length} nodes` + (r.dropped ? ` (+${r.dropped} not shown)` : ""),
        r.merges.length && plural(r.merges.length, "merge edge"), `${fmt(tokens)} tokens`,
        plural(spent.lm_calls || 0, "LM call"), plural(spent.env_steps || 0, "env step"), `stop: ${r.stop_reason}`]
        .filter(Boolean).join(" · ")));
    const byId = new Map(r.nodes.map((n) => [n.id, n])), kids = new Map(r.nodes.map((n) => [n.id, []]));
    for (const n of r.nodes) if (n.p != null && kids.has(n.p)) kids.get(n.p).push(n.id);
    const best = new Set();
    for (let v = r.best; v != null && byId.has(v); v = byId.get(v).p) best.add(v);
    cur = { r, byId, kids, best };
    if (!byId.has(st.selected)) st.selected = r.best ?? r.nodes[0].id;
    draw(true);
  }

  function draw(fit) {
    const { r, byId, kids, best } = cur, nodes = r.nodes;
    const labelled = st.labels ?? nodes.length <= 400;
    const x = tidy(nodes[0].id, kids), DX = labelled ? 62 : 20, DY = 66, PAD = 30;
    const pos = (id) => [PAD + x.get(id) * DX, PAD + byId.get(id).d * DY];
    const get = METRICS[st.colour][1], vals = nodes.map(get).filter((v) => v != null);
    let [lo, hi] = [Math.min(...vals), Math.max(...vals)];
    if (st.colour === "score" && lo >= 0 && hi <= 1) [lo, hi] = [0, 1];
    const scale = st.colour === "visits" ? (v) => Math.log1p(v) / Math.log1p(hi)
      : (v) => (hi > lo ? (v - lo) / (hi - lo) : 0.5);
    const fill = (n) => (get(n) != null ? rampColour(scale(get(n))) : st.colour === "none" ? "#dde6f0" : "#d0d7de");
    const below = labelled ? 27 : 7; // tree edges leave a node under its label
    const edge = (a, b) => {
      const [x1, y0] = pos(a), [x2, y2] = pos(b), y1 = y0 + below, ym = (y1 + y2) / 2;
      return `M${x1},${y1}C${x1},${ym} ${x2},${ym} ${x2},${y2 - 7}`;
    };
    const arc = (a, b) => { // merge edges often join nodes of one level: an arc above them
      const [x1, y1] = pos(a), [x2, y2] = pos(b), lift = 22 + Math.min(90, Math.abs(x2 - x1) * 0.18);
      return `M${x1},${y1 - 7}Q${(x1 + x2) / 2},${Math.min(y1, y2) - lift} ${x2},${y2 - 7}`;
    };
    const edges = s("g", { class: "edges" }), merges = s("g", { class: "merges" });
    const circles = s("g", { class: "nodes" }), labels = s("g", { class: "labels" });
    for (const n of nodes) {
      if (n.p == null || !byId.has(n.p)) continue;
      edges.append(s("path", { class: best.has(n.id) ? "edge best" : "edge", d: edge(n.p, n.id) }));
    }
    for (const [u, v] of r.merges) {
      if (!byId.has(u) || !byId.has(v)) continue;
      merges.append(s("path", { class: "merge", d: arc(u, v) }, s("title", {}, `merge: node ${u} → node ${v}`)));
    }
    for (const n of nodes) {
      const [cx, cy] = pos(n.id), v = get(n), on = best.has(n.id);
      const cls = ["node", n.st, n.t && (n.ok ? "win" : "lose"), on && "onbest", n.id === st.selected && "selected"];
      const tip = `node ${n.id}${n.a != null ? ": " + clipText(n.a, 60) : " (root)"}`
        + (v != null ? `\n${st.colour} ${fmt(v, 3)}` : "");
      const click = (ev) => { ev.stopPropagation(); if (!view.dragged) selectNode(n.id); };
      circles.append(s("circle", { class: cls.filter(Boolean).join(" "), cx, cy, r: on ? 8.5 : 6.5, fill: fill(n),
        "data-id": n.id, on: { click } }, s("title", {}, tip)));
      const text = n.a == null ? "root" : n.a.trim() ? clipText(n.a, 11) : "(no action)";
      if (labelled) labels.append(s("text", { class: on ? "lbl onbest" : "lbl", x: cx, y: cy + 20 }, text));
    }
    const g = s("g", { class: "viewport" }, edges, merges, circles, labels);
    const svg = s("svg", { id: "tree-svg", "data-nodes": nodes.length, "data-task": r.task_id }, g);
    const box = { w: Math.max(...nodes.map((n) => pos(n.id)[0])) + PAD,
      h: Math.max(...nodes.map((n) => pos(n.id)[1])) + PAD + 14 };
    refill(pane, svg, zoomButtons(), key(lo, hi, vals.length, r.merges.length));
    view = panZoom(svg, g, box, fit ? null : view.t);
    if (fit) view.fit();
    showDetails();
  }

  function zoomButtons() {
    const b = (label, title, fn) => h("button", { title, class: label.length > 1 ? "wide" : null, on: { click: fn } }, label);
    const toggleLabels = () => {
      st.labels = !(st.labels ?? cur.r.nodes.length <= 400);
      draw(true);
    };
    return h("div", { class: "zoom" }, b("+", "zoom in", () => view.zoom(1.4)), b("−", "zoom out", () => view.zoom(1 / 1.4)),
      b("fit", "fit the tree", () => view.fit()),
      b("best", "go to the chosen leaf", () => cur.r.best != null && view.centre(cur.r.best)),
      b("labels", "show or hide action labels", toggleLabels));
  }
  function key(lo, hi, nvals, nmerges) {
    const ramp = `background:linear-gradient(90deg,${[0, 0.25, 0.5, 0.75, 1].map(rampColour).join(",")})`;
    const item = (style, text, cls) => h("span", {}, h("i", { class: cls, style }), text);
    return h("div", { class: "keybox" },
      nvals ? h("span", {}, METRICS[st.colour][0] + " ", fmt(lo, 3), h("span", { class: "ramp", style: ramp }), fmt(hi, 3))
        : st.colour !== "none" && h("span", {}, `no ${METRICS[st.colour][0]} in this tree`),
      item("border-color:var(--ok)", "solved"), item("border-color:var(--bad)", "failed end"),
      item("border-color:var(--best)", "chosen path", "line"),
      nmerges > 0 && item("border-color:var(--merge);border-top-style:dashed", "merge (GoT)", "line"),
      item("border-color:#8c959f;border-style:dashed;background:#eef1f4", "pruned"));
  }

  /** Wheel zooms about the pointer, dragging pans; ``dragged`` tells a click from the end of a drag. */
  function panZoom(svg, g, box, keep) {
    const v = { t: keep || { k: 1, x: 0, y: 0 }, dragged: false };
    const apply = () =>
      g.setAttribute("transform", `translate(${v.t.x.toFixed(1)},${v.t.y.toFixed(1)}) scale(${v.t.k.toFixed(4)})`);
    const size = () => [svg.clientWidth || 800, svg.clientHeight || 560];
    v.fit = () => { // under the key and the buttons
      const [W, H] = size(), top = 40, k = Math.min(W / box.w, (H - top - 8) / box.h, 1.15);
      v.t = { k, x: (W - box.w * k) / 2, y: top };
      apply();
    };
    v.zoom = (f, cx, cy) => {
      const [W, H] = size(), k = Math.max(0.05, Math.min(8, v.t.k * f));
      [cx, cy] = [cx ?? W / 2, cy ?? H / 2];
      v.t = { k, x: cx - ((cx - v.t.x) * k) / v.t.k, y: cy - ((cy - v.t.y) * k) / v.t.k };
      apply();
    };
    v.centre = (id) => {
      const c = svg.querySelector(`circle[data-id="${id}"]`), [W, H] = size(), k = Math.max(v.t.k, 1);
      v.t = { k, x: W / 2 - c.cx.baseVal.value * k, y: H / 2 - c.cy.baseVal.value * k };
      apply();
    };
    svg.addEventListener("wheel", (e) => {
      e.preventDefault();
      const r = svg.getBoundingClientRect();
      v.zoom(Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
    }, { passive: false });
    let start = null;
    svg.addEventListener("pointerdown", (e) => {
      start = { x: e.clientX, y: e.clientY, t: { ...v.t } };
      v.dragged = false;
    });
    svg.addEventListener("pointermove", (e) => {
      if (!start) return;
      const dx = e.clientX - start.x, dy = e.clientY - start.y;
      if (!v.dragged && Math.hypot(dx, dy) < 4) return;
      if (!v.dragged) {
        v.dragged = true;
        svg.setPointerCapture(e.pointerId);
        svg.classList.add("dragging");
      }
      v.t = { ...start.t, x: start.t.x + dx, y: start.t.y + dy };
      apply();
    });
    const end = () => { start = null; svg.classList.remove("dragging"); setTimeout(() => { v.dragged = false; }, 0); };
    svg.addEventListener("pointerup", end);
    svg.addEventListener("pointercancel", end);
    apply();
    return v;
  }

  function selectNode(id) {
    st.selected = id;
    for (const c of pane.querySelectorAll("circle.node")) c.classList.toggle("selected", c.dataset.id === String(id));
    showDetails();
  }

  function showDetails() {
    const { r, byId, kids, best } = cur, n = byId.get(st.selected);
    const chip = (id) => h("button", { class: best.has(id) ? "onbest" : null, title: `node ${id}`,
      on: { click: () => selectNode(id) } }, `#${id} ${clipText(byId.get(id).a || (id === r.nodes[0].id ? "root" : ""), 24)}`);
    const chips = (title, ids) => ids.length > 0 && [h("h4", {}, title), h("div", { class: "chips" }, ids.map(chip))];
    const block = (title, text, tag = "pre") =>
      (text ? [h("h4", {}, title), h(tag, { class: tag === "p" ? "text" : null }, text)] : null);
    const pairs = (entries) => h("dl", { class: "kv" }, entries.map(([k, v]) =>
      [h("dt", {}, k), h("dd", {}, typeof v === "number" ? fmt(v, 3) : v ?? "–")]));
    const path = [];
    for (let v = n.id; v != null && byId.has(v); v = byId.get(v).p) path.unshift(byId.get(v));
    const stats = [["score", n.s], ["value Q", n.q], ["visits", n.n], ["prior", n.pr], ["reward", n.r], ["depth", n.d],
      ["status", n.st], ["valid", n.v == null ? null : n.v ? "yes" : "no"]];
    refill(details,
      h("h3", {}, `Node ${n.id}`, n.p == null && h("span", { class: "badge" }, "root"),
        n.t && h("span", { class: "badge " + (n.ok ? "ok" : "bad") }, n.ok ? "solved" : "terminal, failed"),
        best.has(n.id) && h("span", { class: "badge best" }, n.id === r.best ? "chosen" : "on chosen path")),
      pairs(stats),
      block("error", n.err, "p"), n.p == null && block("task", r.instruction, "p"),
      block("thought", n.th, "p"), block("action", n.a), block("observation", n.o),
      block("raw completion (differs from thought + action)", n.c),
      n.info && [h("h4", {}, "info"), pairs(Object.entries(n.info).map(([k, v]) => [k, String(v)]))],
      chips("merged from (GoT)", r.merges.filter(([, v]) => v === n.id).map(([u]) => u)),
      chips("merged into", r.merges.filter(([u]) => u === n.id).map(([, v]) => v)),
      chips(`children (${kids.get(n.id).length})`, kids.get(n.id)),
      path.length > 1 && [h("h4", {}, "path from the root"), h("ol", { class: "path", start: 0 }, path.map((p) =>
        h("li", { class: p.id === n.id ? "here" : null, on: { click: () => selectNode(p.id) } },
          p.p == null ? "root" : `${clipText(p.a, 40)}  (#${p.id})`)))]);
  }

  showTree();
}
