"""Dev-slice power: how often keep-best's dev slice sees a difference the held-out split measured.

Input: the held-out outcomes of two checkpoints on the same tasks (two runs
``FILE[:STRATEGY[@BUDGET]]`` of ``omrl bench``'s ``outcomes.jsonl``, ``A`` the earlier, ``B`` the
candidate), or their discordant counts (``--counts
B_ONLY,A_ONLY,TASKS``). Their rates of "B alone solves it" and "A alone solves it" are taken as
the truth; for each dev-slice size ``n`` the script draws ``--sims`` dev slices of ``n`` tasks
from those rates (a multinomial over B-only, A-only and concordant tasks) and counts how often:

- ``higher``: B's dev score is strictly higher (what ``promote: better`` needs to hand B on);
- ``significant``: B is better with exact McNemar p < ``--alpha`` (the test keep-best runs);
- ``rejected``: B is *worse* with p < alpha (keep-best would reject it).

    python benchmarks/dev_slice_power.py runs/loop-nw/round_1/eval/outcomes.jsonl \\
        runs/loop-nw/round_2/eval/outcomes.jsonl --sizes 100,200,300,500

Prints a table, then as its last line one JSON object with every figure. Seeded: the same
arguments print the same figures.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from omrl_search.paired_runs import load
from omrl_search.stats import mcnemar, mcnemar_p


def discordant(a_spec: str, b_spec: str) -> tuple[int, int, int]:
    """(b_only, a_only, shared tasks) of two runs (``FILE[:STRATEGY[@BUDGET]]``, as
    ``omrl_search.paired_runs`` reads them)."""
    m = mcnemar(load(a_spec)[1], load(b_spec)[1])
    return m["b_only"], m["a_only"], m["tasks"]


def power(b_only: int, a_only: int, tasks: int, n: int, sims: int, alpha: float,
          rng: np.random.Generator) -> dict[str, float]:
    """The three frequencies of the module docstring for a dev slice of ``n`` tasks."""
    probs = [b_only / tasks, a_only / tasks, 1 - (b_only + a_only) / tasks]
    draws = rng.multinomial(n, probs, size=sims)
    higher = significant = rejected = 0
    for b, a, _ in draws:
        higher += b > a
        if mcnemar_p(int(b), int(a)) < alpha:
            significant += b > a
            rejected += a > b
    return {"higher": higher / sims, "significant": significant / sims, "rejected": rejected / sims}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outcomes", nargs="*", help="A's and B's runs, FILE[:STRATEGY[@BUDGET]] (the same tasks)")
    ap.add_argument("--counts", help="B_ONLY,A_ONLY,TASKS instead of two outcome files")
    ap.add_argument("--sizes", default="100,200,300,500,1000", help="dev-slice sizes, comma-separated")
    ap.add_argument("--sims", type=int, default=4000)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.counts:
            b_only, a_only, tasks = (int(x) for x in args.counts.split(","))
        elif len(args.outcomes) == 2:
            b_only, a_only, tasks = discordant(*args.outcomes)
        else:
            raise ValueError("give two outcome files or --counts B_ONLY,A_ONLY,TASKS")
        sizes = [int(x) for x in args.sizes.split(",")]
        if tasks <= 0 or b_only < 0 or a_only < 0 or b_only + a_only > tasks or min(sizes) <= 0:
            raise ValueError(f"counts {b_only},{a_only},{tasks} or sizes {args.sizes} are not possible")
    except (OSError, ValueError, KeyError) as e:
        print(f"dev_slice_power: error: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    rows = {n: power(b_only, a_only, tasks, n, args.sims, args.alpha, rng) for n in sizes}
    print(f"held-out: B alone {b_only}, A alone {a_only} of {tasks} tasks "
          f"({100 * (b_only - a_only) / tasks:+.1f} points); {args.sims} simulated dev slices per size")
    print(f"{'dev tasks':>9}  {'B higher':>8}  {'B better, p<' + str(args.alpha):>16}  {'B rejected':>10}")
    for n, r in rows.items():
        print(f"{n:>9}  {r['higher']:>8.3f}  {r['significant']:>16.3f}  {r['rejected']:>10.3f}")
    print(json.dumps({"b_only": b_only, "a_only": a_only, "tasks": tasks, "alpha": args.alpha,
                      "sims": args.sims, "seed": args.seed, "sizes": {str(n): r for n, r in rows.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
