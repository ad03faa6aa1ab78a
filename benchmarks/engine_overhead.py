"""Engine overhead: how fast the batched engine grows search trees when the LM costs nothing.

Workload: MCTS (rollout values, 4 leaves per round, k=3) and Tree-of-Thoughts BFS (b=5, k=3)
on Game24 test tasks, all searched in lockstep, with a zero-cost scripted policy (a random
``a op b`` move read straight from the request's value snapshot: no env, no solver). The time
is split into the policy, the env (step, snapshot, restore) and the rest: engine + strategy
code (selection, prompt and token bookkeeping, tree updates, batching). The figures of merit
are engine microseconds per node created and, for MCTS, per simulation (selection, expansion
bookkeeping and backup); per-node Python search libraries spend 100+ µs per node in selection
alone.

    python benchmarks/engine_overhead.py [--tasks 100] [--simulations 200] [--repeat 5] [--profile]

Times are this process's CPU time (``time.process_time``), so other processes on a shared
machine inflate them less (they still share caches and cores); each workload runs ``--repeat``
times and the fastest is kept.

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omrl_search as om  # noqa: E402
from envs.arith import fmt  # noqa: E402
from envs.game24 import Game24Env  # noqa: E402
from omrl_search.engine import Engine  # noqa: E402
from omrl_search.policy import ByteChatTokenizer  # noqa: E402

OPS = "+-*/"
#: CPU time of this process: on a shared machine, wall time also counts other processes' turns
CLOCK = time.process_time


class ZeroCostPolicy(om.Policy):
    """A random move on the snapshot's numbers; fixed token ids, so the policy costs ~nothing."""

    name, max_batch = "zero-cost", 1 << 30
    answers_prompts = False

    def __init__(self):
        self.tokenizer = ByteChatTokenizer()
        self.seconds = 0.0

    def generate(self, requests):
        t0 = CLOCK()
        out = []
        for req in requests:
            rng = random.Random(req.params.seed)
            nums = req.meta["snapshot"].payload.numbers
            prompt = len(req.prompt_ids) if req.prompt_ids is not None else 0
            gens = []
            for _ in range(req.params.n):
                if len(nums) < 2:
                    text = "Think: done.\nAct: answer 24"
                else:
                    i, j = rng.sample(range(len(nums)), 2)
                    text = f"Think: try.\nAct: {fmt(nums[i])} {rng.choice(OPS)} {fmt(nums[j])}"
                ids = [rng.randrange(256) for _ in range(8)]
                gens.append(om.Generation(text, ids, [-0.3] * 8, prompt, 8, "stop", True))
            out.append(gens)
        self.seconds += CLOCK() - t0
        return out


class TimedGame24(Game24Env):
    """Game24 that adds the time of its step/snapshot/restore calls to a shared counter."""

    clock = [0.0, 0]

    def step(self, action):
        t0 = CLOCK()
        try:
            return super().step(action)
        finally:
            self.clock[0] += CLOCK() - t0
            self.clock[1] += 1

    def snapshot(self):
        t0 = CLOCK()
        try:
            return super().snapshot()
        finally:
            self.clock[0] += CLOCK() - t0

    def restore(self, snapshot):
        t0 = CLOCK()
        try:
            return super().restore(snapshot)
        finally:
            self.clock[0] += CLOCK() - t0


def measure(name: str, strategy: str, tasks, profile: bool) -> dict:
    policy = ZeroCostPolicy()
    TimedGame24.clock[:] = [0.0, 0]
    engine = Engine(policy, seed=0, env_factory=lambda _: TimedGame24())
    strat = om.make_strategy(strategy)
    prof = cProfile.Profile() if profile else None
    t0 = CLOCK()
    if prof:
        prof.enable()
    results = engine.run(strat, tasks)
    if prof:
        prof.disable()
    cpu = CLOCK() - t0
    nodes = sum(len(r.tree) - 1 for r in results)
    sims = sum(r.tree.root.visits for r in results)  # MCTS: one root visit per simulation
    requests = sum(r.spent["lm_calls"] for r in results)
    env_s, steps = TimedGame24.clock
    engine_s = cpu - env_s - policy.seconds
    if prof:
        print(f"\n--- cProfile: {name} (top 15 by own time) ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {"strategy": strategy, "tasks": len(tasks), "nodes": nodes, "lm_requests": requests,
            "env_steps": steps, "cpu_s": round(cpu, 4), "policy_s": round(policy.seconds, 4),
            "env_s": round(env_s, 4), "engine_s": round(engine_s, 4),
            "nodes_per_s": round(nodes / cpu), "engine_us_per_node": round(1e6 * engine_s / nodes, 2),
            "simulations": sims, "engine_us_per_simulation": round(1e6 * engine_s / sims, 2) if sims else None,
            "engine_share": round(engine_s / cpu, 3), "env_share": round(env_s / cpu, 3),
            "policy_share": round(policy.seconds / cpu, 3),
            "faults": sum(len(r.faults) for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--simulations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="runs per workload; the fastest is kept")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = ap.parse_args()
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    runs = {
        "mcts": f"mcts:simulations={args.simulations},leaves=4,k=3,value=rollout",
        "tot": "tot:method=bfs,b=5,k=3,evaluator=logprob",
    }
    rows = {name: min((measure(name, spec, tasks, args.profile) for _ in range(max(args.repeat, 1))),
                      key=lambda row: row["cpu_s"])
            for name, spec in runs.items()}
    cols = ("nodes", "simulations", "cpu_s", "nodes_per_s", "engine_us_per_node",
            "engine_us_per_simulation", "engine_share", "env_share", "policy_share")
    print(f"Game24, {args.tasks} tasks in lockstep, zero-cost policy, fastest of {args.repeat} runs; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    print(f"{'':6}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for name, row in rows.items():
        print(f"{name:6}" + "".join(f"{str(row[c] if row[c] is not None else '-'):>{len(c) + 2}}" for c in cols))
    print(json.dumps({"benchmark": "engine_overhead", "python": platform.python_version(),
                      "cpus": os.cpu_count(), "repeat": args.repeat, "load_average": os.getloadavg()[0], **{name: row for name, row in rows.items()}}))


if __name__ == "__main__":
    main()
