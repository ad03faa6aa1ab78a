"""Engine overhead: how fast the batched engine grows search trees when the LM costs nothing.

Workload: MCTS (rollout values, 4 leaves per round, k=3) and Tree-of-Thoughts BFS (b=5, k=3)
on Game24 test tasks, all searched in lockstep, with a zero-cost scripted policy (a random
``a op b`` move read straight from the request's value snapshot: no env, no solver). The time
is split into the policy (which times itself), the env (reset, restore, step, snapshot) and the
rest: engine + strategy code (selection, prompt and token bookkeeping, tree updates, batching).
The figures of merit are engine microseconds per node created and, for MCTS, per simulation
(selection, expansion bookkeeping and backup).

    python benchmarks/engine_overhead.py [--tasks 100] [--simulations 200] [--repeat 5] [--profile]

Times are this process's CPU time (``time.process_time``), so other processes on a shared
machine inflate them less (they still share caches and cores); each workload runs ``--repeat``
times and the fastest is kept. The env's share is taken two ways. **Replay**: every tree's env
calls replayed afterwards on a fresh env; a replay runs with warm caches, so it is cheaper than
the same calls inside the search and the engine figure carries that difference. **In search**
(``engine_us_per_node_in_search``): the env times its own ``reset``/``step``/``snapshot`` calls
(:class:`TimedGame24Env`, two ``perf_counter`` reads a call, ~0.1 µs), so the env is charged
what it cost where it ran; wall-clock parts, so run it on a quiet machine. The policy times
itself with ``perf_counter`` too.

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
import time


import omrl_search as om  # noqa: E402
from envs.arith import fmt  # noqa: E402
from envs.game24 import Game24Env  # noqa: E402
from omrl_search.engine import Engine  # noqa: E402
from omrl_search.env import ValueSnapshots  # noqa: E402
from omrl_search.policy import ByteChatTokenizer  # noqa: E402
from omrl_search.tree import FAILED  # noqa: E402

OPS = "+-*/"
#: CPU time of this process: on a shared machine, wall time also counts other processes' turns
CLOCK = time.process_time
#: the clock of the in-search timings (~0.06 us a read, against ~0.7 us for CLOCK's syscall)
WALL = time.perf_counter


def timed(method, holder=None):
    """``method`` with its wall time added to ``holder.seconds`` (default: the timed env's
    total, looked up at call time so the class can wrap its own methods)."""
    def run(*args, **kwargs):
        t0 = WALL()
        try:
            return method(*args, **kwargs)
        finally:
            (holder or TimedGame24Env).seconds += WALL() - t0
    return run


class TimedGame24Env(Game24Env):
    """``Game24Env`` adding the wall time of its ``reset``, ``step`` and ``snapshot`` calls to
    the class total ``seconds``: the env's share as spent inside the search, caches as the
    search left them (two clock reads a call). ``restore`` is not wrapped: the engine sets a
    value snapshot's state itself, and the reference world model times its own restore."""

    seconds = 0.0
    reset = timed(Game24Env.reset)
    step = timed(Game24Env.step)
    snapshot = timed(Game24Env.snapshot)


def random_move(rng: random.Random, nums) -> str:
    """A random ``a op b`` on two of ``nums`` (the move rule of the zero-cost policy; the
    reference benchmark's library side draws its moves with it too)."""
    i, j = rng.sample(range(len(nums)), 2)
    return f"{fmt(nums[i])} {rng.choice(OPS)} {fmt(nums[j])}"


class ZeroCostPolicy(om.Policy):
    """A random move on the snapshot's numbers; fixed token ids, so the policy costs ~nothing."""

    name, max_batch = "zero-cost", 1 << 30
    answers_prompts = False
    shares_prefixes = False  # no KV cache: the engine need not sort prompts for it
    reads_messages = False  # reads the snapshot only: step requests need no chat messages

    def __init__(self):
        self.tokenizer = ByteChatTokenizer()
        self.seconds = 0.0

    def generate(self, requests):
        t0 = WALL()
        out = []
        for req in requests:
            rng = random.Random(req.params.seed)
            nums = req.meta["snapshot"].payload.numbers
            prompt = len(req.prompt_ids) if req.prompt_ids is not None else 0
            gens = []
            for _ in range(req.params.n):
                text = "Think: done.\nAct: answer 24" if len(nums) < 2 else \
                    "Think: try.\nAct: " + random_move(rng, nums)
                ids = [rng.randrange(256) for _ in range(8)]
                gens.append(om.Generation(text, ids, [-0.3] * 8, prompt, 8, "stop", True))
            out.append(gens)
        self.seconds += WALL() - t0
        return out


def env_calls(results) -> list[tuple]:
    """Each tree's env calls in the engine's order: per node that reached the env, the parent's
    snapshot to restore (None where the env already held that state) and the action."""
    out = []
    for r in results:
        nodes, at, steps = r.tree.nodes, 0, []
        for n in nodes[1:]:
            if n.step.action:  # a malformed completion never reaches the env
                steps.append((nodes[n.parent].snapshot if n.parent != at else None, n.step.action))
                at = n.id if n.status != FAILED else None
        out.append((r.task, steps))
    return out


def env_seconds(results, env_cls=Game24Env) -> tuple[float, int]:
    """CPU time of the searches' env work, measured apart: each tree's calls (reset and
    snapshot, then restore, step and snapshot per node, as the engine made them) replayed on a
    fresh env under one clock pair. Timing every call inside the search would add two clock
    reads per call (~0.6 µs each on a VM) to the figures."""
    trees = env_calls(results)
    t0 = CLOCK()
    for task, steps in trees:
        env = env_cls()
        env.reset(task)
        env.snapshot()
        for snap, action in steps:
            if snap is not None:
                env.restore(snap)
            env.step(action)
            env.snapshot()
    return CLOCK() - t0, sum(len(steps) for _, steps in trees)


def measure(name: str, strategy: str, tasks, profile: bool) -> dict:
    policy = ZeroCostPolicy()
    engine = Engine(policy, seed=0, env_factory=lambda _: TimedGame24Env())
    TimedGame24Env.seconds = 0.0
    strat = om.make_strategy(strategy)
    prof = cProfile.Profile() if profile else None
    t0 = CLOCK()
    if prof:
        prof.enable()
    results = engine.run(strat, tasks)
    if prof:
        prof.disable()
    cpu = CLOCK() - t0
    env_in_search = TimedGame24Env.seconds
    nodes = sum(len(r.tree) - 1 for r in results)
    sims = sum(r.tree.root.visits for r in results)  # MCTS: one root visit per simulation
    requests = sum(r.spent["lm_calls"] for r in results)
    env_s, steps = env_seconds(results)
    engine_s = cpu - env_s - policy.seconds
    if prof:
        print(f"\n--- cProfile: {name} (top 15 by own time) ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {"strategy": strategy, "tasks": len(tasks), "nodes": nodes, "lm_requests": requests,
            "env_steps": steps, "cpu_s": round(cpu, 4), "policy_s": round(policy.seconds, 4),
            "env_s": round(env_s, 4), "engine_s": round(engine_s, 4),
            "env_in_search_s": round(env_in_search, 4),
            "engine_us_per_node_in_search": round(1e6 * (cpu - env_in_search - policy.seconds) / nodes, 2),
            "nodes_per_s": round(nodes / cpu), "engine_us_per_node": round(1e6 * engine_s / nodes, 2),
            "simulations": sims, "engine_us_per_simulation": round(1e6 * engine_s / sims, 2) if sims else None,
            "engine_share": round(engine_s / cpu, 3), "env_share": round(env_s / cpu, 3),
            "policy_share": round(policy.seconds / cpu, 3),
            "faults": sum(len(r.faults) for r in results),
            "trees_with_success": sum(any(n.success for n in r.tree.nodes) for r in results)}


class LineEnv(ValueSnapshots, om.Env):
    """A walk where every action leads to a new state (``(depth, action)``), finished at
    depth ``max_steps``: trees as large as asked, at a fixed depth, for the scaling rows."""

    name, max_steps = "overhead_line", 12
    action_help = "Actions: `step N`."

    def reset(self, task) -> str:
        self.state = (0, "")
        return self.observe()

    def observe(self) -> str:
        return f"Depth {self.state[0]}, last {self.state[1]!r}."

    def step(self, action: str) -> om.StepResult:
        depth = self.state[0] + 1
        self.state = (depth, action)
        return om.StepResult(self.observe(), 0.0, terminated=depth >= self.max_steps)


class LinePolicy(ZeroCostPolicy):
    """``step N`` with a random N: distinct children, fixed token ids, ~no cost."""

    def generate(self, requests):
        t0 = WALL()
        out = []
        for req in requests:
            rng = random.Random(req.params.seed)
            prompt = len(req.prompt_ids) if req.prompt_ids is not None else 0
            out.append([om.Generation(f"Think: go.\nAct: step {rng.randrange(10**9)}", [7] * 8,
                                      [-0.3] * 8, prompt, 8, "stop", True)
                        for _ in range(req.params.n)])
        self.seconds += WALL() - t0
        return out


def scaling_specs(nodes: int) -> dict[str, str]:
    """One tree of about ``nodes`` nodes per strategy, at depth <= 12: beam's width and MCTS's
    simulations grow with the size (DFS stops at the engine's node cap)."""
    return {"beam": f"beam:width={max(1, nodes // 36)},k=3,value=logprob",
            "mcts": f"mcts:simulations={nodes},leaves=16,k=3,value=logprob",
            "dfs": "tot:method=dfs,k=3,evaluator=logprob"}


def measure_scaling(name: str, spec: str, nodes: int) -> dict:
    """One search of one :class:`LineEnv` task capped at ``nodes`` nodes: µs per node of the
    engine + strategy (the env replayed and the policy's clock subtracted, as above)."""
    policy = LinePolicy()
    engine = Engine(policy, seed=0, env_factory=lambda _: LineEnv(), max_nodes=nodes)
    task = om.Task(LineEnv.name, "line-0", instruction="Walk.")
    t0 = CLOCK()
    (result,) = engine.run(om.make_strategy(spec), [task])
    cpu = CLOCK() - t0
    env_s, _ = env_seconds([result], LineEnv)
    made = len(result.tree) - 1
    return {"strategy": name, "cap": nodes, "nodes": made, "cpu_s": round(cpu, 4),
            "engine_us_per_node": round(1e6 * (cpu - env_s - policy.seconds) / made, 2),
            "stop_reason": result.stop_reason}


def workloads(simulations: int) -> dict[str, str]:
    """The strategy specs timed here, by name."""
    return {"mcts": f"mcts:simulations={simulations},leaves=4,k=3,value=rollout",
            "tot": "tot:method=bfs,b=5,k=3,evaluator=logprob",
            "beam": "beam:width=5,k=3,value=logprob",
            "dfs": "tot:method=dfs,k=3,evaluator=logprob"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--simulations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="runs per workload; the fastest is kept")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    ap.add_argument("--scaling", default="", metavar="N,N,...",
                    help="instead: engine µs per node of one tree of each size (e.g. 1000,10000,100000)")
    args = ap.parse_args()
    if args.scaling:
        rows = []
        for size in (int(x) for x in args.scaling.split(",")):
            for name, spec in scaling_specs(size).items():
                runs = [measure_scaling(name, spec, size) for _ in range(max(args.repeat, 1))]
                rows.append(min(runs, key=lambda r: r["cpu_s"]))
                r = rows[-1]
                print(f"{name:5} cap {size:>7} nodes {r['nodes']:>7} engine µs/node "
                      f"{r['engine_us_per_node']:>7} ({r['stop_reason']})", flush=True)
        print(json.dumps({"benchmark": "engine_overhead_scaling", "python": platform.python_version(),
                          "load_average": os.getloadavg()[0], "rows": rows}))
        return
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    runs = workloads(args.simulations)
    rows = {name: min((measure(name, spec, tasks, args.profile) for _ in range(max(args.repeat, 1))),
                      key=lambda row: row["cpu_s"])
            for name, spec in runs.items()}
    cols = ("nodes", "simulations", "cpu_s", "nodes_per_s", "engine_us_per_node",
            "engine_us_per_node_in_search", "engine_us_per_simulation", "engine_share", "env_share", "policy_share")
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
