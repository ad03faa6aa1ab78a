/* omrl report, part 3 of 3: the page: header, scaling plots, search trees, rounds, result tables and
   training curves, each drawn only when the data has it. */

DATA.evals.forEach((e) => e.rows.forEach((r) => colourOf(r.strategy)));
const hasTrees = DATA.evals.some((e) => e.trees.some((g) => g.results.length));
const card = (id, title, sub, controls, ...body) =>
  h("section", { class: "card", id }, h("h2", {}, title, h("span", { class: "sub" }, sub), controls), body);

function header(before) {
  const one = DATA.evals.length === 1 ? DATA.evals[0].config : null, loop = DATA.loop;
  const meta = loop
    ? [`loop: ${loop.env}`, `policy ${loop.policy}`, loop.search_strategy && `search ${loop.search_strategy} @ ${loop.search_budget}`,
      plural(DATA.rounds.length, "round"), loop.seed != null && `seed ${loop.seed}`]
    : one
    ? [one.env && `${one.env} · ${one.split}`, one.tasks != null && `${one.tasks} tasks`,
      one.policy && `policy ${one.policy}`, one.reward_model && `reward model ${one.reward_model}`,
      one.budget_kind && `budgets ${one.budget_kind}=${one.budgets.join(", ")}`, one.seed != null && `seed ${one.seed}`]
    : [[DATA.evals.length, "result set"], [DATA.training.length, "training run"], [DATA.rounds.length, "round"]]
      .filter(([n]) => n).map(([n, w]) => plural(n, w));
  const links = [["scaling", "Scaling", DATA.evals.length], ["trees", "Search trees", hasTrees],
    ["rounds", "Rounds", DATA.rounds.length], ["results", "Results", DATA.evals.length],
    ["training", "Training", DATA.training.length]].filter((l) => l[2]);
  document.body.insertBefore(h("header", { class: "top" }, h("h1", {}, "omrl report ", h("span", {}, DATA.title)),
    h("div", { class: "meta" }, meta.filter(Boolean).join("  ·  ")),
    h("nav", {}, links.map(([id, text]) => h("a", { href: "#" + id }, text)))), before);
  if (DATA.notes.length) {
    document.body.insertBefore(h("ul", { class: "notes" }, DATA.notes.map((n) => h("li", {}, n))), before);
  }
}

/** Success rate against tokens, env steps and seconds spent per task: a line per strategy, a point
    per budget; one result set or all of them (the default unless that makes more than 12 lines). */
function scalingSection() {
  const many = DATA.evals.length > 1;
  const lines = DATA.evals.reduce((n, e) => n + new Set(e.rows.map((r) => r.strategy)).size, 0);
  let choice = many && lines > 12 ? String(lastBench(DATA.evals.map((e, i) => [i, e]))) : "all";
  const plots = h("div", { class: "plots" });
  function draw() {
    const evs = choice === "all" ? DATA.evals : [DATA.evals[+choice]], series = [];
    evs.forEach((e) => {
      const byStrategy = new Map();
      for (const r of e.rows) byStrategy.set(r.strategy, [...(byStrategy.get(r.strategy) || []), r]);
      for (const [name, rows] of byStrategy) {
        const verifier = rows.some((r) => r.verifier_in_loop);
        const prefix = evs.length > 1 ? evalName(e) + " · " : "";
        const colour = evs.length > 1 ? PALETTE[series.length % PALETTE.length] : colourOf(name); // tell sets apart
        series.push({ name: prefix + name + (verifier ? " *" : ""), dashed: verifier, colour, rows });
      }
    });
    const point = (r, key) => ({ x: r[key], y: r.success_rate, lo: r.ci_low, hi: r.ci_high, label: r.budget });
    refill(plots, [["tokens", "tokens spent"], ["env_steps", "env steps"], ["seconds", "wall seconds"]].map(([key, what]) =>
      lineChart({ title: `Success vs ${what}`, xlabel: `${what} per task`, ylabel: "success rate", ymin: 0, ymax: 1,
        height: 240, series: series.map((sr) => ({ ...sr, points: sr.rows.map((r) => point(r, key)) })) })));
  }
  const options = [["all", "all result sets"], ...DATA.evals.map((e, i) => [String(i), evalName(e)])];
  draw();
  const sub = "one line per strategy, one point per budget; mean per task; bars: 95% interval; * verifier in the loop (dashed)";
  return card("scaling", "Success against compute", sub, many && pick("results", select(options, choice, (v) => {
    choice = v;
    draw();
  })), plots);
}

/** A success rate: a bar with its 95% interval drawn over it, the rate and the interval. */
function rateCell(r) {
  const pct = (v) => (v * 100).toFixed(1) + "%";
  const bar = h("span", { class: "bar", style: `width:${pct(r.success_rate)}` });
  const ci = r.ci_low != null && h("span", { class: "ci", style: `left:${pct(r.ci_low)};width:${pct(r.ci_high - r.ci_low)}` });
  const title = `${r.successes}/${r.tasks} solved` + (ci ? `; Wilson 95% interval ${r.ci_low.toFixed(3)} to ${r.ci_high.toFixed(3)}` : "");
  return h("td", { class: "rate", title }, h("span", { class: "track" }, bar, ci), h("b", {}, r.success_rate.toFixed(2)),
    ci && h("span", { class: "interval" }, ` [${r.ci_low.toFixed(2)}, ${r.ci_high.toFixed(2)}]`));
}

/** The paired test against the first strategy: difference, tasks only each solved, exact McNemar p. */
function pairedCell(r) {
  const p = r.paired;
  if (!p) return h("td", { class: "muted" }, "–");
  const sign = p.diff > 0 ? "+" : "";
  const title = `${p.b_only} of ${p.tasks} tasks solved only by ${r.strategy}, ${p.a_only} only by ${p.vs} (exact McNemar, two-sided)`;
  return h("td", { class: "paired" + (p.p_value < 0.05 ? " sig" : ""), title },
    `${sign}${p.diff.toFixed(2)} `, h("span", { class: "muted" }, `(${p.b_only} vs ${p.a_only}) `),
    `p=${+p.p_value.toPrecision(2)}`);
}

/** One table per result set: every strategy at every budget, with the compute spent per task. */
function resultsSection() {
  const sets = DATA.evals.map((e, i) => {
    const c = e.config, rows = [], vs = (e.rows.find((r) => r.paired) || {}).paired;
    const head = ["strategy", "budget", "success [95% CI]", "solved", vs && `vs ${vs.vs} (McNemar)`, "tokens", "prefill", "cached", "LM calls",
      "RM calls", "env steps", "seconds", "faults"].filter(Boolean);
    e.rows.forEach((r, j) => {
      const first = j === 0 || e.rows[j - 1].strategy !== r.strategy;
      const name = first && h("span", {}, h("span", { class: "swatch", style: `background:${colourOf(r.strategy)}` }),
        r.strategy + (r.verifier_in_loop ? " *" : ""));
      rows.push(h("tr", { class: first && j ? "first" : null }, h("td", { class: "l", title: r.spec }, name),
        h("td", { class: "l" }, r.budget || "–"), rateCell(r), h("td", {}, `${r.successes}/${r.tasks}`), vs && pairedCell(r),
        [r.tokens, r.prefill_tokens, r.cached_tokens, r.lm_calls, r.rm_calls, r.env_steps].map((v) => h("td", {}, fmt(v))), h("td", {}, fmt(r.seconds, 3)),
        h("td", {}, r.faults)));
    });
    const what = [e.kind, c.env && `${c.env} ${c.split || ""}`, c.tasks != null && `${c.tasks} tasks`,
      c.policy && `policy ${c.policy}`, e.round != null && `round ${e.round}`].filter(Boolean).join(" · ");
    return h("details", { class: "set", open: i === DATA.evals.length - 1 || DATA.evals.length <= 3 },
      h("summary", {}, h("b", {}, evalName(e)), "  ", h("span", { class: "muted" }, what)),
      h("div", { class: "scroll-x" }, h("table", { class: "grid" },
        h("thead", {}, h("tr", {}, head.map((t, j) => h("th", { class: j < 2 ? "l" : null }, t)))), h("tbody", {}, rows))));
  });
  return card("results", "Results per strategy and budget",
    "95% Wilson intervals; paired: against the first strategy at the same budget on the same tasks (bold: p < 0.05); " +
    "compute is the mean spent per task", null, sets);
}

/** Loops: each round's evaluation (strategy @ budget by round), its training's last loss, a plot of
    success by round and each round's report.md. */
function roundsSection() {
  const inRounds = DATA.evals.filter((e) => e.round != null);
  const benches = inRounds.some((e) => e.kind === "bench") ? inRounds.filter((e) => e.kind === "bench") : inRounds;
  const several = inRounds.some((e) => inRounds.filter((x) => x.round === e.round).length > 1); // name the folder too
  const key = (e, r) =>
    (several ? e.id.split("/").pop() + " · " : "") + (r.budget ? `${r.strategy} @ ${r.budget}` : r.strategy);
  const byKey = new Map(); // [folder ·] strategy @ budget -> round -> summary row
  for (const e of inRounds) {
    for (const r of e.rows) byKey.set(key(e, r), (byKey.get(key(e, r)) || new Map()).set(e.round, r));
  }
  const rounds = DATA.rounds.map((rd) => rd.round);
  const kinds = [...new Set(DATA.training.filter((t) => t.round != null).map((t) => t.kind))];
  const lastLoss = (t) => t && t.series.loss && t.series.loss[t.series.loss.length - 1];
  const evalRows = [...byKey].map(([k, per]) => h("tr", {}, h("td", { class: "l" }, k),
    rounds.map((rd) => (per.has(rd) ? rateCell(per.get(rd)) : h("td", {}, "–")))));
  const trainRows = kinds.map((kind, i) => h("tr", { class: i ? null : "first" },
    h("td", { class: "l" }, `${kind} training: last loss`), rounds.map((rd) => {
      const t = DATA.training.find((x) => x.round === rd && x.kind === kind), l = lastLoss(t);
      return h("td", { title: t && t.id }, l ? `${l[1].toPrecision(3)} (step ${l[0]})` : "–");
    })));
  const table = h("div", { class: "scroll-x" }, h("table", { class: "grid" },
    h("thead", {}, h("tr", {}, h("th", { class: "l" }, "evaluation"), rounds.map((rd) => h("th", {}, `round ${rd}`)))),
    h("tbody", {}, evalRows, trainRows)));
  const largest = new Map(); // strategy -> its key with the largest budget, in the evaluations (benches)
  const plotted = new Set(benches.flatMap((e) => e.rows.map((r) => key(e, r))));
  for (const [k, per] of byKey) {
    if (!plotted.has(k)) continue;
    const budget = (key) => byKey.get(key).values().next().value.budget_value || 0;
    const r = per.values().next().value, prev = largest.get(r.strategy);
    if (!prev || budget(k) > budget(prev)) largest.set(r.strategy, k);
  }
  const plot = rounds.length > 1 && byKey.size > 0 && h("div", { class: "plots" }, lineChart({
    title: "Success by round (each strategy at its largest budget)", xlabel: "round", ylabel: "success rate",
    ymin: 0, ymax: 1, logx: false, xint: true,
    series: [...largest].map(([name, k]) => ({ name: k, colour: colourOf(name),
      points: [...byKey.get(k)].map(([rd, r]) => ({ x: rd, y: r.success_rate, lo: r.ci_low, hi: r.ci_high,
        label: `round ${rd}` })) })) }));
  const reports = DATA.rounds.filter((rd) => rd.report_md).map((rd) =>
    h("details", { class: "set" }, h("summary", {}, h("b", {}, `${rd.id}/report.md`)),
      h("pre", { class: "md" }, rd.report_md)));
  const sub = "success rate of each round's evaluation, and the last logged loss of each round's training";
  return card("rounds", "Rounds", sub, null, table, plot, reports);
}

/** One chart per training run (metrics.jsonl), the metric picked for all (loss by default). */
function trainingSection() {
  const metrics = [...new Set(DATA.training.flatMap((t) => Object.keys(t.series)))];
  let metric = metrics.includes("loss") ? "loss" : metrics[0];
  const grid = h("div", { class: "trainplots" });
  const draw = () => refill(grid, DATA.training.map((t, i) => lineChart({
    title: `${t.kind} · ${t.id || DATA.title}${t.bad_lines ? ` (${plural(t.bad_lines, "unreadable line")})` : ""}`,
    xlabel: "optimizer step", ylabel: metric, logx: false, height: 240,
    series: [{ name: "", colour: PALETTE[i % PALETTE.length], markers: false,
      points: (t.series[metric] || []).map(([x, y]) => ({ x, y })) }],
  })));
  draw();
  const choose = select(metrics.map((k) => [k, k]), metric, (v) => {
    metric = v;
    draw();
  });
  return card("training", "Training curves", "from metrics.jsonl", pick("metric", choose), grid);
}

const app = document.getElementById("app"), main = h("main");
header(app);
app.replaceWith(main);
if (DATA.evals.length) main.append(scalingSection());
if (hasTrees) treeSection(main);
else if (DATA.evals.length) {
  main.append(card("trees", "Search trees", "none in these results (omrl bench saves them with --save-trees)"));
}
if (DATA.rounds.length) main.append(roundsSection());
if (DATA.evals.length) main.append(resultsSection());
if (DATA.training.length) main.append(trainingSection());
document.documentElement.setAttribute("data-ready", "1");
