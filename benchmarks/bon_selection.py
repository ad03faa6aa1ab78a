"""Best-of-N selection rules on the same chains: a reward model's choice against majority vote.

One ``omrl bench --save-trees`` run of ``best_of_n:n=N,select_by=rm`` with a reward model keeps
every chain and every chain's score. On those same chains, per task, this script picks an answer
three ways, none of which asks the env whether a chain succeeded:

* ``rm`` — the chain the reward model scored highest (what the search itself returned);
* ``vote`` — majority vote over the finished chains' final answers (self-consistency), the
  engine's own :func:`omrl_search.strategy.majority_vote`;
* ``first`` — the first chain (what one sample would have given);

and reports each one's success with its Wilson 95% interval, ``rm`` and ``first`` against
``vote`` by an exact McNemar test on the same tasks, and ``pass@N`` (some chain succeeded: the
ceiling of any selection rule). Because the chains are shared, a difference is the selection
rule's alone, not sampling noise between two runs.

    omrl bench --env game24 --split test --limit 200 --policy smollm2 --agent act --max-tokens 16 \\
        --strategies best_of_n:n=8,select_by=rm --reward-model prm:PRM --budgets tokens=20000 \\
        --seed 1 --save-trees --out runs/bon8
    python benchmarks/bon_selection.py 'runs/bon8/trees/best_of_n@tokens=20000.jsonl'

``--reward-model SPEC`` rescores the saved chains with another reward model first (e.g. the
implicit PRM of a trained policy, ``implicit:hf:POLICY,ref=smollm2``): its value of each whole
chain replaces the saved score, so several reward models are compared on one set of chains.

Prints a table, then one JSON object as its last line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def choices(result, rm=None) -> dict[str, bool] | None:
    """Whether each rule's chain succeeded in one best-of-N tree (None: no chain); with ``rm``
    (a reward model) the chains are rescored by its value first."""
    from omrl_search.strategy import majority_vote

    leaves = [n for n in result.tree.leaves() if n.parent is not None]
    if not leaves:
        return None
    if rm is not None:
        for n, v in zip(leaves, rm.value([result.tree.trajectory(n) for n in leaves])):
            n.score = float(v)
    scored = [n for n in leaves if n.score is not None]
    if not scored:
        raise ValueError(f"task {result.task.task_id}: no chain has a reward-model score "
                         "(run best_of_n with select_by=rm and --reward-model)")
    vote = majority_vote(n for n in leaves if n.terminal) or leaves[0]
    return {"rm": max(scored, key=lambda n: n.score).success, "vote": vote.success,
            "first": leaves[0].success, "pass@n": any(n.success for n in leaves)}


def compare(files: list[str], reward_model: str | None = None) -> dict:
    from omrl_search.result import read_results
    from omrl_search.reward import make_reward_model
    from omrl_search.stats import mcnemar, rate

    rm = make_reward_model(reward_model) if reward_model else None

    picked: dict[str, dict[str, bool]] = {"rm": {}, "vote": {}, "first": {}, "pass@n": {}}
    chains = []
    for f in files:
        for r in read_results(f):
            got = choices(r, rm)
            if got is None:
                continue
            chains.append(sum(1 for n in r.tree.leaves() if n.parent is not None))
            for rule, ok in got.items():
                picked[rule][r.task.task_id] = bool(ok)
    if not chains:
        raise ValueError("no best-of-N tree with a chain in the files given")
    tasks = len(picked["rm"])
    out = {"tasks": tasks, "chains_per_task": round(sum(chains) / tasks, 2), "reward_model": reward_model,
           "rules": {rule: rate(sum(v.values()), tasks) for rule, v in picked.items()}}
    for rule in ("rm", "first"):
        out["rules"][rule]["vs_vote"] = mcnemar(picked["vote"], picked[rule])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="saved trees of a best_of_n select_by=rm run (TREES.jsonl)")
    ap.add_argument("--reward-model", help="rescore the chains with this reward model spec first")
    args = ap.parse_args()
    missing = [f for f in args.trees if not Path(f).is_file()]
    if missing:
        ap.error(f"no such trees file: {missing[0]}")
    try:
        out = compare(args.trees, args.reward_model)
    except ValueError as exc:  # a file that is not best-of-N trees with scores: one line, exit 2
        print(f"bon_selection: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"{out['tasks']} tasks, {out['chains_per_task']} chains a task")
    for rule, row in out["rules"].items():
        vs = row.get("vs_vote")
        tail = f"  vs vote: {vs['b_only']} vs {vs['a_only']}, p = {vs['p_value']}" if vs else ""
        print(f"{rule:7} {row['successes']:>4}/{row['tasks']} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]{tail}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
