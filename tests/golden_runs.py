"""Golden seeded runs: every strategy over three envs, both schedules, faults and budgets.

Each run is a seeded search with a scripted policy, so its trees are fixed by the code that
grows them. :func:`digest` hashes everything a search decides (every node's fields, the step
each carries, the best leaf, spend, faults, stop reasons) and nothing the clock decides.
``tests/data/golden_trees.json`` holds the digests taken before a refactor of the engine; the
test in ``tests/test_golden_trees.py`` checks that the code still grows the same trees.

Refresh the file only for a change that is *meant* to change trees, and say so in the commit:
``python tests/golden_runs.py --write``.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_trees.json"

STRATEGIES = (
    "react",
    "best_of_n:n=3",
    "beam:width=2,k=2",
    "beam:value=rm,agg=min",
    "tot:b=2,k=3",
    "tot:method=dfs,k=3,evaluator=logprob",
    "tot:k=3,b=2,evaluator=heuristic,dedup=text",
    "mcts:simulations=16,leaves=3,k=2",
    "mcts:simulations=16,leaves=3,k=2,value=rollout",
    "mcts:priors=policy,simulations=40,solver=true,stop_on_success=true",
    "got",
    "tot:b=2,k=2,evaluator=rm",
    "dfsdt",
)
ENVS = ("game24", "countdown", "sokoban")
POLICIES = ("scripted:oracle:p=0.4", "scripted:oracle:p=0.3,malformed=0.2", "scripted:random")
#: the clock's fields: never part of a digest
_TIMED = {"seconds", "wall_seconds"}


def runs():
    """(name, keyword arguments of ``search_many``) for every golden run."""
    out = []
    for strategy in STRATEGIES:
        for env in ENVS:
            for p, policy in enumerate(POLICIES):
                schedule = ("continuous", "lockstep")[p % 2]
                budget = "tokens=600" if p == 2 else None
                name = f"{strategy}|{env}|{policy}|{schedule}|{budget}"
                out.append((name, dict(env=env, strategy=strategy, policy=policy,
                                       schedule=schedule, budget=budget)))
    return out


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if k not in _TIMED}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return repr(x)
    return x


def digest(results) -> str:
    h = hashlib.sha256()
    for r in results:
        h.update(json.dumps(_clean(json.loads(r.to_json())), sort_keys=True).encode())
    return h.hexdigest()[:16]


def run_one(env, strategy, policy, schedule, budget) -> str:
    import omrl_search as om

    tasks = om.load_tasks(env, "test", limit=3)
    res = om.search_many(tasks, strategy=strategy, policy=policy, schedule=schedule,
                         budget=budget, seed=7, max_depth=6, concurrency=2,
                         reward_model="rules:format=0.2,outcome=1" if "=rm" in strategy else None)
    return digest(res)


def compute() -> dict[str, str]:
    return {name: run_one(**kw) for name, kw in runs()}


if __name__ == "__main__":
    got = compute()
    if "--write" in sys.argv:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} digests to {GOLDEN}")
    else:
        want = json.loads(GOLDEN.read_text())
        bad = [k for k in got if want.get(k) != got[k]]
        print(f"{len(got) - len(bad)}/{len(got)} runs match" + "".join(f"\n  differs: {k}" for k in bad))
