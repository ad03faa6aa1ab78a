"""What a PRM costs a search: CPU time per MCTS simulation with policy priors alone, and with a
PRM as the value (issue goal: at most 1.5x), at the same settings, on the bundled SmolLM2.

Both sides run ``mcts:priors=policy`` with a fixed number of simulations and no early stop, so
each task runs them all; the PRM side adds ``value=rm``. Each side gets a fresh policy (and a
fresh PRM) so neither starts on the other's warm prefix cache; the sides alternate ``--repeat``
times. CPU time is this process's (user + system), around the search calls only (loading the
weights is left out). The PRM's cost depends on its size, not on its training, so by default it
is a fresh one: the bottom ``--keep-layers`` blocks of the bundled model and a new head (what
``omrl loop`` trains: configs/loop-game24.yaml's ``keep_layers: 8``); ``--prm DIR`` takes a
trained one.

    python benchmarks/prm_search_cost.py --env game24 --tasks 8 --simulations 24 --repeat 2

Prints one line per run, then as its last line one JSON object with the medians and the ratio.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fresh_prm(base: str, keep_layers: int, folder: str) -> str:
    from reward_models.prm import ProcessRewardModel

    ProcessRewardModel.from_base(base, keep_layers=keep_layers, device="cpu", dtype="float32",
                                 seed=0).save_pretrained(folder)
    return folder


def run_side(name: str, tasks: list, strategy: str, policy_spec: str, prm_dir: str | None,
             seed: int, max_tokens: int) -> dict:
    import omrl_search as om
    from omrl_search.host import policy_dtype

    policy = om.make_policy(policy_spec)
    rm = None
    if prm_dir is not None:
        from reward_models.prm import ProcessRewardModel

        rm = ProcessRewardModel.from_pretrained(prm_dir, device="cpu", dtype="float32")
    start = cpu_seconds()
    results = om.search_many(tasks, strategy=strategy, policy=policy, reward_model=rm, seed=seed,
                             agent="act", sampling=om.SamplingParams(max_tokens=max_tokens),
                             budget="tokens=10000000", concurrency=len(tasks))
    cpu = cpu_seconds() - start
    spent = {k: sum(r.spent.get(k, 0) for r in results) for k in
             ("tokens", "prefill_tokens", "lm_calls", "rm_calls", "rm_tokens")}
    row = {"side": name, "cpu_s": round(cpu, 2), "nodes": sum(len(r.tree.nodes) for r in results),
           "dtype": policy_dtype(policy), "successes": sum(r.success for r in results), "faults": sum(len(r.faults) for r in results),
           **spent}
    if rm is not None:
        row["prm_cache"] = {k: v for k, v in rm.stats().get("prefix_cache", {}).items() if k != "kv"}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="game24")
    ap.add_argument("--split", default="test")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--simulations", type=int, default=24)
    ap.add_argument("--policy", default="smollm2")
    ap.add_argument("--prm", default=None, help="a trained PRM folder (default: a fresh cut)")
    ap.add_argument("--keep-layers", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import omrl_search as om
    from omrl_search.host import describe, host_info

    tasks = om.load_tasks(args.env, split=args.split, limit=args.tasks)
    base = (f"mcts:priors=policy,simulations={args.simulations},stop_on_success=false,"
            "solver=false")
    sides = {"priors": (base, None), "priors+prm": (base + ",value=rm", "PRM")}
    with tempfile.TemporaryDirectory() as tmp:
        prm_dir = args.prm or fresh_prm(args.policy, args.keep_layers, tmp)
        rows = []
        for rep in range(args.repeat):
            for name, (strategy, uses) in sides.items():
                row = run_side(name, tasks, strategy, args.policy, prm_dir if uses else None,
                               args.seed, args.max_tokens)
                row["repeat"] = rep
                rows.append(row)
                print(json.dumps(row), flush=True)
    sims = args.tasks * args.simulations
    per_sim = {name: statistics.median(r["cpu_s"] for r in rows if r["side"] == name) / sims
               for name in sides}
    summary = {"env": args.env, "tasks": args.tasks, "simulations": args.simulations,
               "policy": args.policy, "prm": args.prm or f"fresh, keep_layers={args.keep_layers}",
               "host": describe(host_info(), rows[0]["dtype"]), "cpu_ms_per_simulation": {k: round(v * 1e3, 1) for k, v in per_sim.items()},
               "ratio": round(per_sim["priors+prm"] / per_sim["priors"], 3), "runs": rows}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
