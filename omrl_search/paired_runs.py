"""Two runs on the same tasks, compared task by task: each one's rate with its Wilson 95% interval
and an exact McNemar test of the second against the first.

``omrl bench`` pairs the strategies of one run; this pairs strategies of *different* runs (a
PRM-guided search run after the heuristic one, a checkpoint against the base model), reading
each bench's ``outcomes.jsonl``. A run is ``FILE[:STRATEGY[@BUDGET]]``; with several strategies
in a file, name one.

    python -m omrl_search.paired_runs runs/bench-loop-countdown/outcomes.jsonl:mcts@tokens=3000 \
        runs/bench-prm-countdown/outcomes.jsonl:mcts@tokens=3000

Prints one line per run and the test, then as its last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys


def load(spec: str) -> tuple[str, dict[str, bool], dict[str, float]]:
    """``(name, task -> success, mean spent per task)`` of one run spec."""
    path, _, pick = spec.partition(":")
    strategy, _, budget = pick.partition("@")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    keys = sorted({(r["strategy"], r["budget"]) for r in rows})
    chosen = [k for k in keys if (not strategy or k[0] == strategy) and (not budget or k[1] == budget)]
    if len(chosen) != 1:
        sys.exit(f"paired_runs: {spec}: name one of {', '.join(f'{s}@{b}' for s, b in keys)}")
    rows = [r for r in rows if (r["strategy"], r["budget"]) == chosen[0]]
    spent: dict[str, float] = {}
    for key in ("tokens", "rm_tokens", "lm_calls", "seconds"):
        spent[key] = round(sum(r["spent"].get(key, 0) for r in rows) / max(len(rows), 1), 1)
    return f"{path}:{chosen[0][0]}@{chosen[0][1]}", {r["task_id"]: bool(r["success"]) for r in rows}, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the baseline run, FILE[:STRATEGY[@BUDGET]]")
    ap.add_argument("b", help="the run compared with it")
    args = ap.parse_args()

    from omrl_search.stats import fmt_paired, fmt_rate, mcnemar, rate

    runs = [load(args.a), load(args.b)]
    shared = sorted(set(runs[0][1]) & set(runs[1][1]))
    out = {"runs": []}
    for name, res, spent in runs:
        row = rate(sum(res[t] for t in shared), len(shared))
        out["runs"].append({"run": name, **row, "per_task": spent})
        print(f"{fmt_rate(row)}  {name}  per task: {spent}")
    test = mcnemar(runs[0][1], runs[1][1])
    out["paired"] = test
    print(f"second vs first on {test['tasks']} shared tasks: {fmt_paired(test)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
