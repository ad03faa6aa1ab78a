"""Tokens -> success from one `omrl bench` run: the tasks a search solved within B tokens.

A search stopped on its first success (``stop_on_success=true``) records the tokens it had
spent then; the same seeded search given a budget of B tokens runs the same calls until B, so
it solves exactly the tasks whose recorded spend is at most B (counted conservatively: a task
whose solving call started under B but ended past it counts as unsolved at B). One run at the
largest budget therefore gives the whole curve. Each point carries its Wilson 95% interval and
an exact McNemar test against the baseline strategy (e.g. greedy ReAct) on the same tasks.

    python benchmarks/anytime_curve.py runs/g24 --strategy mcts --baseline react \\
        --budgets 1000,2000,5000,10000,20000 --out benchmarks/results/game24-untrained-scaling.json

``--versus DIR --versus-strategy NAME`` sets another run (e.g. the same search guided by a
PRM, run once at one budget) against this curve at that run's budget, on the same tasks: both
success rates, the other run's tokens and ``rm_tokens`` a task, and the exact McNemar test.

    python benchmarks/anytime_curve.py runs/g24 --strategy mcts --budgets 3000 \
        --versus runs/mcts-prm --versus-strategy mcts

Prints a table; with ``--out``, also writes the curve as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class CurveError(Exception):
    """Bad input: one line, exit 2."""


def load_outcomes(folder: Path) -> list[dict]:
    path = folder / "outcomes.jsonl"
    if not path.is_file():
        raise CurveError(f"{path}: no such file (an `omrl bench --out` folder?)")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise CurveError(f"{path}:{i}: {exc}") from None
    return rows


def curve(rows: list[dict], strategy: str, baseline: str | None, budgets: list[int]) -> dict:
    from omrl_search.stats import mcnemar, rate

    runs = {r["strategy"] for r in rows}
    if strategy not in runs or (baseline and baseline not in runs):
        missing = strategy if strategy not in runs else baseline
        raise CurveError(f"no {missing!r} rows (strategies: {', '.join(sorted(runs))})")
    search = {r["task_id"]: r for r in rows if r["strategy"] == strategy}
    points = []
    base = None
    if baseline:
        base_rows = {r["task_id"]: r for r in rows if r["strategy"] == baseline}
        base = {t: bool(base_rows[t]["success"]) for t in search if t in base_rows}
        n = len(base)
        points.append({"strategy": baseline, "tokens": None, **rate(sum(base.values()), n),
                       "tokens_per_task": round(sum(base_rows[t]["spent"]["tokens"] for t in base) / n)})
    for b in budgets:
        won = {t: bool(r["success"]) and r["spent"]["tokens"] <= b for t, r in search.items()}
        spent = [min(r["spent"]["tokens"], b) for r in search.values()]
        point = {"strategy": strategy, "tokens": b, **rate(sum(won.values()), len(won)),
                 "tokens_per_task": round(sum(spent) / len(spent))}
        if base is not None:
            point["vs_baseline"] = mcnemar(base, {t: won[t] for t in base})
        points.append(point)
    return {"tasks": len(search), "points": points}


def versus(rows: list[dict], strategy: str, other: list[dict], other_strategy: str) -> dict:
    """``other_strategy`` of the ``other`` run against ``strategy`` of this one cut at the other
    run's token budget (its rows' ``budget``, one for all), on the tasks both ran."""
    from omrl_search.stats import mcnemar, rate

    theirs = {r["task_id"]: r for r in other if r["strategy"] == other_strategy}
    if not theirs:
        raise CurveError(f"no {other_strategy!r} rows in the --versus run")
    budgets = {r["budget"] for r in theirs.values()}
    if len(budgets) != 1 or not next(iter(budgets)).startswith("tokens="):
        raise CurveError(f"the --versus run needs one token budget, has {sorted(budgets)}")
    b = int(next(iter(budgets)).removeprefix("tokens="))
    mine = {r["task_id"]: bool(r["success"]) and r["spent"]["tokens"] <= b
            for r in rows if r["strategy"] == strategy and r["task_id"] in theirs}
    if not mine:
        raise CurveError(f"no {strategy!r} task of this run is in the --versus run")
    got = {t: bool(theirs[t]["success"]) for t in mine}
    n = len(mine)
    return {"tokens": b, "this": rate(sum(mine.values()), n), "other": rate(sum(got.values()), n),
            "other_tokens_per_task": round(sum(theirs[t]["spent"]["tokens"] for t in mine) / n),
            "other_rm_tokens_per_task": round(sum(theirs[t]["spent"].get("rm_tokens", 0) for t in mine) / n),
            "mcnemar": mcnemar(mine, got)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="an `omrl bench --out` folder (its outcomes.jsonl)")
    ap.add_argument("--strategy", required=True, help="the search's strategy name in outcomes.jsonl")
    ap.add_argument("--baseline", default=None, help="a strategy to test each point against")
    ap.add_argument("--budgets", required=True, help="comma-separated token budgets, e.g. 1000,5000")
    ap.add_argument("--out", type=Path, default=None, help="write the curve here as JSON")
    ap.add_argument("--versus", type=Path, default=None,
                    help="another bench folder at one token budget, tested against this curve there")
    ap.add_argument("--versus-strategy", default=None, help="its strategy name (default: --strategy)")
    ap.add_argument("--note", default="", help="free text kept in the JSON (command, host, ...)")
    args = ap.parse_args(argv)
    try:
        budgets = sorted({int(b) for b in args.budgets.split(",")})
    except ValueError:
        print(f"anytime_curve: error: --budgets must be integers, got {args.budgets!r}", file=sys.stderr)
        return 2
    if not budgets or budgets[0] <= 0:
        print("anytime_curve: error: --budgets must be positive", file=sys.stderr)
        return 2
    try:
        rows = load_outcomes(args.folder)
        result = curve(rows, args.strategy, args.baseline, budgets)
        if args.versus:
            result["versus"] = versus(rows, args.strategy, load_outcomes(args.versus),
                                      args.versus_strategy or args.strategy)
    except CurveError as exc:
        print(f"anytime_curve: error: {exc}", file=sys.stderr)
        return 2
    for p in result["points"]:
        vs = p.get("vs_baseline")
        extra = f"  vs {args.baseline}: {vs['b_only']} vs {vs['a_only']}, p={vs['p_value']:.2g}" if vs else ""
        label = f"{p['strategy']}@{p['tokens']}" if p["tokens"] else p["strategy"]
        print(f"{label:>16}  {p['successes']:>3}/{p['tasks']} = {p['success_rate']:.3f} "
              f"[{p['ci_low']:.3f}, {p['ci_high']:.3f}]  {p['tokens_per_task']:>6} tokens/task{extra}")
    if "versus" in result:
        v = result["versus"]
        t, o, m = v["this"], v["other"], v["mcnemar"]
        print(f"at {v['tokens']} tokens on {m['tasks']} tasks: this {t['successes']} "
              f"[{t['ci_low']:.3f}, {t['ci_high']:.3f}], {args.versus} {o['successes']} "
              f"[{o['ci_low']:.3f}, {o['ci_high']:.3f}] ({v['other_tokens_per_task']} tokens, "
              f"{v['other_rm_tokens_per_task']} rm_tokens a task); {m['b_only']} vs {m['a_only']}, "
              f"p={m['p_value']:.2g}")
    if args.out:
        result["note"] = args.note
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
