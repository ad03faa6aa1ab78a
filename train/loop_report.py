"""The loop's per-round report (``round_R/report.md``, the run's ``report.md``; ``report.html`` shows
it with the eval plots and training curves): held-out success with Wilson 95% intervals per
strategy and budget, each round against the one before on the same test tasks (exact McNemar),
what keep-best kept on the dev slice and why, the curriculum's choice, search and data counts, and
the PRM's validation AUC and calibration.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omrl_search.host import describe
from omrl_search.stats import fmt_paired, fmt_rate, mcnemar, paired

from .loop_stages import bench_outcomes, policy_spec


def _na(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def test_tables(cfg: Any, history: list[dict[str, Any]]) -> list[str]:
    rounds = [h["round"] for h in history]
    first = history[0]["eval"]["rows"]
    tasks = next(iter(next(iter(first.values())).values()))["tasks"]
    lines = [f"## Held-out success ({cfg.env} test split, {tasks} tasks)", "",
             "Successes / tasks = rate [Wilson 95% interval]. Round 0: the base policy; round r: the "
             "policy kept after round r's stages" + (", with round r's PRM (from round 1)." if cfg.prm else "."), "",
             "| strategy | budget | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|---|" + "---|" * len(rounds)]
    for name, per in first.items():
        for budget in per:
            cells = [fmt_rate(h["eval"]["rows"][name][budget]) if budget in h["eval"]["rows"].get(name, {})
                     else "-" for h in history]
            lines.append(f"| {name} | {budget} | " + " | ".join(cells) + " |")
    if len(history) > 1:
        outs = {h["round"]: bench_outcomes(Path(cfg.out) / f"round_{h['round']}" / "eval") for h in history}
        lines += ["", "Each round against the round before on the same test tasks (exact McNemar): the "
                  "difference in success rate, tasks solved only now vs only before, p-value.", "",
                  "| strategy | budget | " + " | ".join(f"round {r} vs {r - 1}" for r in rounds[1:]) + " |",
                  "|---|---|" + "---|" * (len(rounds) - 1)]
        for name, per in first.items():
            for budget in per:
                cells = []
                for r in rounds[1:]:
                    a = outs[r - 1].get(name, {}).get(budget)
                    b = outs[r].get(name, {}).get(budget)
                    cells.append(fmt_paired(paired(f"round {r - 1}", a, b)) if a and b else "-")
                lines.append(f"| {name} | {budget} | " + " | ".join(cells) + " |")
    return lines


def _dev_cell(dev: dict[str, Any] | None) -> str:
    if not dev:
        return "-"
    return "; ".join(f"{n} {fmt_rate(next(iter(per.values())))}" for n, per in dev["rows"].items())


def keep_table(cfg: Any, history: list[dict[str, Any]], best: dict[str, Any]) -> list[str]:
    lines = [f"## Keep-best on the dev slice ({cfg.dev_limit} train-split tasks, no puzzle trained on)", ""]
    if not cfg.dev_limit:
        return lines + ["No dev slice (`dev_limit: 0`): every stage was kept unchecked.", ""]
    lines += [f"After each training stage: {cfg.dev_strategies} at {cfg.dev_budget} on the dev slice; "
              f"the stage is rejected when any of them is worse than the best checkpoint, or than one "
              f"that was the best before it, with paired p < {cfg.keep_alpha:g} (exact McNemar), else "
              + ("kept, and it becomes the best when its dev score (mean success) is higher"
                 if cfg.promote == "better" else "kept as the new best (`promote: not_worse`)")
              + "; training continues from "
              + ("the best." if cfg.continue_from == "best" else "the last kept stage."), "",
              "| round | stage | trained | dev success | decision | why |", "|---|---|---|---|---|---|",
              f"| 0 | base | `{cfg.policy}` | {_dev_cell(history[0].get('dev'))} | best | the starting policy |"]
    for h in history[1:]:
        for st in h.get("stages", []):
            t, dev = st["train"], st.get("dev")
            if "skipped" in t:
                lines.append(f"| {h['round']} | {t['trainer']} | skipped: {t['skipped']} | - | - | - |")
                continue
            trained = f"{t.get('step', '?')} steps, loss {_na(t.get('loss'))}"
            dec = (dev or {}).get("decision") or {"keep": True, "new_best": False, "reason": "no dev check"}
            verdict = ("**new best**" if dec.get("new_best") else "**rejected**" if not dec["keep"]
                       else "kept" if cfg.continue_from == "kept" else "not better: not trained on")
            lines.append(f"| {h['round']} | {t['trainer']} | {trained} | {_dev_cell(dev)} | {verdict} | "
                         f"{dec['reason']} |")
    lines += ["", f"Best checkpoint: `{best['model']}` ({best['where']}, dev score {_na(best.get('score'))}).", ""]
    return lines


def round_table(history: list[dict[str, Any]]) -> list[str]:
    lines = ["## Search, curriculum and data per round", "",
             "| round | curriculum: search success per level → trained on | train-split search success | "
             "demos | rows sft/rs_sft/dpo/grpo |", "|---|---|---|---|---|"]
    for h in history[1:]:
        cur = h.get("curriculum")
        cur_cell = "-" if not cur else (", ".join(f"{n}: {s}/{t}" for n, (s, t) in cur["counts"].items())
                                         + f" → {', '.join(cur['chosen'])} ({cur['reason']})")
        s = h["search"]["search"]
        rows = h["data"]["rows"]
        lines.append(f"| {h['round']} | {cur_cell} | {s['successes']}/{s['tasks']} | "
                     f"{h['search'].get('demos', {}).get('tasks', 0)} | "
                     + "/".join(str(rows.get(k, 0)) for k in ("sft", "rs_sft", "dpo", "grpo")) + " |")
    return lines + [""]


def prm_table(history: list[dict[str, Any]]) -> list[str]:
    prms = [(h["round"], h["prm"], (h.get("eval") or {}).get("prm_heldout") or {})
            for h in history[1:] if (h.get("prm") or {}).get("trained")]
    if not prms:
        return []
    lines = ["## PRM", "",
             "Validation: steps of its own label rows (they include the solver demonstrations, which "
             "flatter it); held-out: the round's test-split eval trees, labelled from their own leaves, "
             "steps before the end.", "",
             "| round | validation steps | step AUC | AUC before the end | ECE | ECE before the end "
             "| held-out steps | held-out AUC | held-out ECE |", "|---|---|---|---|---|---|---|---|---|"]
    for r, p, h in prms:
        v, c, hb = p.get("validation") or {}, p.get("calibration") or {}, h.get("before_end") or {}
        lines.append(f"| {r} | {v.get('steps', '-')} | {_na(v.get('auc'))} | {_na(v.get('auc_before_end'))} | "
                     f"{_na((c.get('all') or {}).get('ece'))} | {_na((c.get('before_end') or {}).get('ece'))} | "
                     f"{hb.get('steps', '-')} | {_na(hb.get('auc'))} | {_na((hb.get('calibration') or {}).get('ece'))} |")
    r, p, _ = prms[-1]
    table = ((p.get("calibration") or {}).get("all") or {}).get("bins")
    if table:
        lines += ["", f"Reliability of round {r}'s PRM (all validation steps): mean score vs mean "
                  "Monte-Carlo value per score bin.", "", "| score bin | steps | mean score | mean value |",
                  "|---|---|---|---|"]
        lines += [f"| {b['lo']:.1f}-{b['hi']:.1f} | {b['steps']} | {b['mean_pred']:.3f} | {b['mean_label']:.3f} |"
                  for b in table]
    return lines + [""]


def round_report(cfg: Any, history: list[dict[str, Any]], best: dict[str, Any]) -> str:
    """The whole report after the last round in ``history``."""
    lines = [f"# omrl loop: {cfg.env}, base policy `{cfg.policy}`, rounds 0-{history[-1]['round']}", ""]
    last = history[-1]["eval"]
    if last.get("host"):  # every figure below was taken on this host, in this dtype
        lines += [describe(last["host"], last.get("dtype")), ""]
    lines += test_tables(cfg, history) + [""]
    lines += ["![held-out success per round](learning_curve.png) ![tokens per solved task](tokens_per_solved.png)", ""]
    lines += keep_table(cfg, history, best)
    if len(history) > 1:
        lines += round_table(history) + prm_table(history)
    return "\n".join(lines).rstrip() + "\n"


# --- the results file: what a reader checks a measured loop by ---------------------------------------
_RATE = {"type": "object", "required": ["tasks", "successes", "ci_low", "ci_high"],
         "properties": {"tasks": {"type": "integer", "minimum": 1}, "successes": {"type": "integer", "minimum": 0},
                        "ci_low": {"type": "number"}, "ci_high": {"type": "number"}}}
#: JSON Schema of ``OUT/results.json`` (benchmarks/results/loop-*.json are copies of it)
RESULTS_SCHEMA = {
    "type": "object",
    "required": ["env", "command", "git", "host", "hours", "heldout_strategy", "rounds", "search_on_best"],
    "properties": {
        "env": {"type": "string"}, "command": {"type": "string"}, "git": {"type": ["string", "null"]},
        "host": {"type": "object", "required": ["cpu", "bf16_native", "dtype"]},
        "hours": {"type": "number", "minimum": 0}, "heldout_strategy": {"type": "string"},
        "rounds": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["round", "policy", "heldout", "vs_previous", "train_search"],
            "properties": {
                "round": {"type": "integer", "minimum": 0}, "policy": {"type": "string"}, "heldout": _RATE,
                "vs_previous": {"type": ["object", "null"], "required": ["b_only", "a_only", "p_value"]},
                # the commits the round's stages ran at (a run stopped and started again may mix)
                "git": {"type": "array", "items": {"type": "string"}},
                "train_search": {"type": ["object", "null"], "required": ["tasks", "successes", "rows"]}}}},
        "search_on_best": {"type": ["object", "null"], "required": ["strategy", "tasks", "successes",
                                                                    "tokens_per_task", "ci_low", "ci_high"]},
        # written once the rounds are over (a loop with a dev slice): the checkpoint keep-best hands back
        "best": {"type": ["object", "null"], "required": ["model", "where", "heldout", "vs_base"],
                 "properties": {"heldout": _RATE}}}}


def results_record(cfg: Any, history: list[dict[str, Any]], *, command: str, git: str | None,
                   hours: float, search_on_best: dict[str, Any] | None = None,
                   best: dict[str, Any] | None = None) -> dict[str, Any]:
    """``OUT/results.json``: per round the kept policy's held-out success on the first eval
    strategy and budget (greedy by default) with its Wilson interval, against the round before
    on the same tasks (exact McNemar), and the round's train-split search (tasks, successes,
    rows per export); ``search_on_best`` is the separate search on the kept checkpoint when one
    was run (None otherwise), with ``vs_best_greedy`` when ``best`` is given. ``best`` (keep-best's
    ``model`` and ``where``, and ``eval``: its own test eval when no round's was of it) becomes
    the record's ``best``: its held-out success and ``vs_base``, the base policy on the same
    tasks. Schema: :data:`RESULTS_SCHEMA`."""
    name = next(iter(history[0]["eval"]["rows"]))  # the rows follow eval_strategies' order
    budget = next(iter(history[0]["eval"]["rows"][name]))
    outs = {h["round"]: bench_outcomes(Path(cfg.out) / f"round_{h['round']}" / "eval") for h in history}
    last = history[-1]["eval"]
    rounds = []
    for h in history:
        r, row = h["round"], h["eval"]["rows"][name][budget]
        before, now = outs.get(r - 1, {}).get(name, {}).get(budget), outs[r].get(name, {}).get(budget)
        vs = _versus(before, now) if r > 0 else None
        search = None
        if r > 0:
            s = h["search"]["search"]
            search = {"tasks": s["tasks"], "successes": s["successes"],
                      "rows": {k: v for k, v in h["data"]["rows"].items() if isinstance(v, int)}}
        rounds.append({"round": r, "policy": h.get("policy") or h["eval"].get("policy") or cfg.policy,
                       "heldout": {k: row[k] for k in ("tasks", "successes", "ci_low", "ci_high")},
                       "vs_previous": vs, "train_search": search,
                       "git": sorted({i["git"] for i in stage_infos(h) if i.get("git")})})
    host = dict(last.get("host") or {})
    host["dtype"] = last.get("dtype")
    record = {"env": cfg.env, "command": command, "git": git, "host": host, "hours": round(hours, 3),
              "heldout_strategy": f"{name}@{budget}", "rounds": rounds, "search_on_best": search_on_best}
    if best is not None:
        record["best"], greedy = _best_record(cfg, history, best, name, budget, outs)
        if search_on_best is not None:
            (per,) = bench_outcomes(Path(cfg.out) / "search_on_best").values()
            (searched,) = per.values()
            record["search_on_best"] = {**search_on_best, "vs_best_greedy": _versus(greedy, searched)}
    return record


def stage_infos(round_info: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``stage.json`` records of one round's history entry: its stages (curriculum, search,
    labels, prm, data, eval) and each trainer's train and dev stage."""
    infos = [v for k, v in round_info.items() if k not in ("round", "policy", "stages")]
    infos += [s[k] for s in round_info.get("stages", []) for k in ("train", "dev")]
    return [i for i in infos if isinstance(i, dict)]


def _versus(before: dict[str, bool] | None, now: dict[str, bool] | None) -> dict[str, Any] | None:
    """Exact McNemar of ``now`` against ``before`` on the same tasks (None without both)."""
    if not before or not now:
        return None
    test = mcnemar(before, now)
    return {k: test[k] for k in ("b_only", "a_only", "p_value")}


def _best_record(cfg: Any, history: list[dict[str, Any]], best: dict[str, Any], name: str, budget: str,
                 outs: dict[int, Any]) -> tuple[dict[str, Any], dict[str, bool] | None]:
    """The best checkpoint's held-out record and its per-task outcomes, from its own eval
    (``best["eval"]``, folder ``eval_best``) or from the round whose eval was of it."""
    if best.get("eval"):
        row, mine = best["eval"]["rows"][name][budget], bench_outcomes(Path(cfg.out) / "eval_best")
    else:
        h = next(h for h in history if h["eval"].get("policy") == policy_spec(best["model"]))
        row, mine = h["eval"]["rows"][name][budget], outs[h["round"]]
    mine = mine.get(name, {}).get(budget)
    return {"model": best["model"], "where": best["where"],
            "heldout": {k: row[k] for k in ("tasks", "successes", "ci_low", "ci_high")},
            "vs_base": _versus(outs[0].get(name, {}).get(budget), mine)}, mine


# --- learning curves ----------------------------------------------------------------------------------
def curve_points(history: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per eval ``strategy@budget``, one point per round: held-out success with its Wilson
    interval and the tokens spent per solved task (prompt + completion over successes; None
    when nothing was solved)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for h in history:
        for name, per in h["eval"]["rows"].items():
            for budget, row in per.items():
                solved = row["successes"]
                tokens = row.get("prompt_tokens", 0) + row.get("completion_tokens", 0)
                out.setdefault(f"{name}@{budget}", []).append({
                    "round": h["round"], "success_rate": row["success_rate"], "ci_low": row["ci_low"],
                    "ci_high": row["ci_high"], "tokens_per_solved": round(tokens / solved) if solved else None})
    return out


def plot_curves(history: list[dict[str, Any]], folder: Path) -> list[Path]:
    """``learning_curve.png`` (held-out success per round, Wilson 95% intervals) and
    ``tokens_per_solved.png`` (tokens per solved task per round), one line per eval strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, paths = curve_points(history), []
    for name, ylabel in (("learning_curve.png", "held-out success (95% interval)"),
                         ("tokens_per_solved.png", "tokens per solved task")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, (label, pts) in enumerate(points.items()):
            if name == "learning_curve.png":
                ax.errorbar([p["round"] for p in pts], [p["success_rate"] for p in pts],
                            yerr=[[p["success_rate"] - p["ci_low"] for p in pts],
                                  [p["ci_high"] - p["success_rate"] for p in pts]],
                            marker="osv^DPX*"[i % 8], capsize=3, label=label)
            else:
                kept = [p for p in pts if p["tokens_per_solved"] is not None]
                ax.plot([p["round"] for p in kept], [p["tokens_per_solved"] for p in kept],
                        marker="osv^DPX*"[i % 8], label=label)
        ax.set_xlabel("round (0: the base policy)")
        ax.set_ylabel(ylabel)
        ax.set_xticks([h["round"] for h in history])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
