"""Engine overhead next to a per-node Python search library: llm-reasoners' MCTS, same workload.

Runs the MCTS workload of ``benchmarks/engine_overhead.py`` (its own code path: ``measure``
with the same spec) and then the same search through llm-reasoners 1.0.2
(``reasoners.algorithm.mcts.MCTS``, a ``WorldModel`` + ``SearchConfig`` per task), alternating
the two ``--repeat`` times in one process and keeping each side's fastest run, so both figures
come from the same interpreter, machine and minute.

    pip install llm-reasoners==1.0.2 --no-deps && pip install numpy tqdm   # a scratch venv
    python benchmarks/engine_overhead_reference.py [--tasks 100] [--simulations 200] [--repeat 5]

Both sides: Game24 test tasks, our ``Game24Env`` stepping the state (restore the parent's value
snapshot, step, snapshot), k=3 candidate moves per expansion drawn with the same rule
(``engine_overhead.random_move``: two random numbers and a random op, from a seeded RNG), value
1 at a solved terminal and 0 otherwise, 200 simulations (omrl: backups; llm-reasoners:
``n_iters``), depth limit 6 (the env's step limit). Times are process CPU time; the env and the
policy are subtracted the same way on both sides where possible: the env by replaying every
tree's env calls afterwards on a fresh env (omrl: ``engine_overhead.env_seconds``;
llm-reasoners: the world model's ``init_state``, ``step`` and ``is_terminal`` calls, read off
the final tree), the policy by its own clock (omrl) or by replaying every ``SearchConfig`` hook
(``get_actions``, ``fast_reward``, ``reward``) the search made (llm-reasoners). What is left is
"overhead": omrl's engine + strategy code, or llm-reasoners' MCTS code.

What differs, and whom it favours:

* omrl's overhead includes work that llm-reasoners leaves to the user's hooks, which here do
  no such work (favours llm-reasoners): building each request's chat messages and prompt token
  ids, parsing the ``Think:/Act:`` completion, budget and token accounting, per-state dedup.
* omrl searches all tasks in lockstep, 4 leaves per round with virtual loss, and batches the LM
  requests of every tree; llm-reasoners searches one task at a time, one leaf per iteration,
  and has no batching machinery to pay for (favours llm-reasoners).
* llm-reasoners creates a child per proposed action but steps the env only for a child it
  visits; its simulation expands every node on the rollout path (k proposals each) and
  follows the first child (``simulate_strategy='max'`` on equal fast rewards; the moves are
  random, so the rollout is random). omrl steps every proposed child (its count includes
  children pruned as duplicate states) and its rollout proposes one move per step. ``nodes``
  counts env-stepped nodes on both sides, rollout nodes included, so llm-reasoners' per-node
  figure also carries its never-stepped children (against it); the ``per_child`` column
  divides by children created instead (for it).
* UCT on Q = the mean of a node's list of cumulative rewards (llm-reasoners keeps every
  backup's value, so each Q costs O(visits)) vs PUCT on running sums with priors (omrl).
  llm-reasoners' default ``calc_q`` is ``np.mean``; the ``py-mean`` row passes a pure-Python
  mean, the cheapest its API allows. Its ``np.sqrt``/``np.log`` in UCT are not configurable.
* With 200 simulations both sides exhaust most of the ~40-node trees (3 moves per state, 3
  combines to the end), so most simulations re-visit finished paths (about 5 per node);
  ``--simulations 20`` shows the expansion-bound regime, where the gap is much smaller.
* ``import reasoners`` imports torch and transformers (its ``base.py``, for the LM classes);
  MCTS uses neither. Where they are not installed, empty stand-in modules are placed in
  ``sys.modules`` for that import only (and removed after), so the library's code runs
  unmodified without a 1 GB install; with them installed the import is plain.

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_overhead as eo  # noqa: E402  (puts the repo root on sys.path)
import omrl_search as om  # noqa: E402
from envs.game24 import Game24Env  # noqa: E402

INSTALL = "pip install llm-reasoners==1.0.2 --no-deps && pip install numpy tqdm"
CLOCK = eo.CLOCK


def import_reasoners_mcts():
    """``(reasoners.algorithm.mcts, note)``, or ``(None, why)`` when llm-reasoners is missing."""
    if importlib.util.find_spec("reasoners") is None:
        return None, "llm-reasoners is not installed"
    stand_ins = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    for name in stand_ins:
        sys.modules[name] = types.ModuleType(name)
    if "transformers" in stand_ins:
        sys.modules["transformers"].StoppingCriteriaList = list  # only an annotation in base.py
    try:
        from reasoners.algorithm import mcts
    except ImportError as exc:
        return None, f"cannot import reasoners.algorithm.mcts: {exc}"
    finally:
        for name in stand_ins:
            del sys.modules[name]
    note = f"stand-ins for {', '.join(stand_ins)} during import" if stand_ins else "plain import"
    return mcts, note


def make_hooks():
    """The ``WorldModel`` and ``SearchConfig`` classes over our Game24 env (zero-cost policy)."""
    from reasoners import SearchConfig, WorldModel

    class Game24World(WorldModel):
        """States are our env's value snapshots; a step restores, steps and snapshots."""

        def __init__(self, task):
            super().__init__()
            self.task, self.env = task, Game24Env()

        def init_state(self):
            self.env.reset(self.task)
            return self.env.snapshot()

        def step(self, state, action):
            env = self.env
            env.restore(state)
            res = env.step(action)
            return env.snapshot(), {"success": bool(res.info.get("success", False))}

        def is_terminal(self, state):
            return state.payload.done

    class RandomMoves(SearchConfig):
        """k moves by ``engine_overhead.random_move`` from a fresh RNG per call (as the zero-cost
        policy seeds one per request); reward 1 for the step that solves the puzzle."""

        def __init__(self, k: int, seed: int):
            super().__init__()
            self.k, self.seed, self.calls = k, seed, 0

        def get_actions(self, state):
            self.calls += 1
            rng, nums = random.Random(self.seed * 1_000_003 + self.calls), state.payload.numbers
            return [eo.random_move(rng, nums) for _ in range(self.k)]

        def reward(self, state, action, success=False, **_):
            return (1.0 if success else 0.0), {}

    return Game24World, RandomMoves


def walk(root):
    """Every node of an llm-reasoners tree (placeholders included)."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if node.children:
            stack.extend(node.children)


def replay_seconds(world_cls, config_cls, k: int, trees) -> tuple[float, float]:
    """CPU seconds of the env calls and of the hook calls the searches made, replayed from the
    final trees on fresh objects (the call lists are gathered before the clock starts)."""
    calls = []
    for task, root in trees:
        nodes = list(walk(root))
        steps = [(n.parent.state, n.action, n.state) for n in nodes
                 if n.parent is not None and n.state is not None]
        asked = [n for n in nodes if n.children is not None]
        calls.append((task, steps, [n.state for n in asked],
                      [(n.state, c.action) for n in asked for c in n.children]))
    t0 = CLOCK()
    for task, steps, _, _ in calls:
        world = world_cls(task)
        world.init_state()
        step, terminal = world.step, world.is_terminal
        for parent, action, state in steps:
            step(parent, action)
            terminal(state)
    env_s, t0 = CLOCK() - t0, CLOCK()
    for i, (task, steps, asked, proposed) in enumerate(calls):
        config = config_cls(k, i)
        actions, fast, reward = config.get_actions, config.fast_reward, config.reward
        for state in asked:
            actions(state)
        for state, action in proposed:
            fast(state, action)
        for parent, action, state in steps:
            reward(parent, action, success=state.payload.success)
    return env_s, CLOCK() - t0


def measure_reasoners(mcts, tasks, simulations: int, k: int, calc_q) -> dict:
    world_cls, config_cls = make_hooks()
    algo = mcts.MCTS(n_iters=simulations, depth_limit=Game24Env.max_steps, w_exp=1.0,
                     calc_q=calc_q, disable_tqdm=True)
    t0 = CLOCK()
    trees = [(task, algo(world_cls(task), config_cls(k, i)).tree_state)
             for i, task in enumerate(tasks)]
    cpu = CLOCK() - t0
    env_s, policy_s = replay_seconds(world_cls, config_cls, k, trees)
    all_nodes = [n for _, root in trees for n in walk(root)]
    nodes = sum(1 for n in all_nodes if n.parent is not None and n.state is not None)
    sims = sum(len(root.cum_rewards) for _, root in trees)
    solved = sum(any(n.state is not None and n.state.payload.success for n in walk(root))
                 for _, root in trees)
    return row(cpu, env_s, policy_s, nodes, sims, len(all_nodes) - len(trees), solved)


def row(cpu: float, env_s: float, policy_s: float, nodes: int, sims: int, created: int,
        solved: int) -> dict:
    over = cpu - env_s - policy_s
    return {"nodes": nodes, "children_created": created, "simulations": sims,
            "trees_with_success": solved, "cpu_s": round(cpu, 4), "env_s": round(env_s, 4),
            "policy_s": round(policy_s, 4), "overhead_s": round(over, 4),
            "us_per_node": round(1e6 * cpu / nodes, 2),
            "env_us_per_node": round(1e6 * env_s / nodes, 2),
            "policy_us_per_node": round(1e6 * policy_s / nodes, 2),
            "overhead_us_per_node": round(1e6 * over / nodes, 2),
            "overhead_us_per_child": round(1e6 * over / created, 2),
            "overhead_us_per_simulation": round(1e6 * over / sims, 2)}


def measure_omrl(tasks, simulations: int) -> dict:
    """``engine_overhead.measure`` on its MCTS spec, in this table's terms."""
    r = eo.measure("mcts", eo.workloads(simulations)["mcts"], tasks, profile=False)
    return row(r["cpu_s"], r["env_s"], r["policy_s"], r["nodes"], r["simulations"], r["nodes"],
               r["trees_with_success"])


def python_mean(xs):
    """Q for llm-reasoners' ``calc_q`` without numpy's per-call array conversion."""
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--simulations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="runs per side; the fastest is kept")
    args = ap.parse_args()
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    mcts, note = import_reasoners_mcts()
    sides = {"omrl-search": lambda: measure_omrl(tasks, args.simulations)}
    if mcts is not None:
        import numpy as np
        sides["llm-reasoners"] = lambda: measure_reasoners(mcts, tasks, args.simulations, 3, np.mean)
        sides["llm-reasoners py-mean"] = lambda: measure_reasoners(
            mcts, tasks, args.simulations, 3, python_mean)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(max(args.repeat, 1)):  # alternate the sides so they share the machine's state
        for name, fn in sides.items():
            runs[name].append(fn())
    rows = {name: min(rs, key=lambda r: r["cpu_s"]) for name, rs in runs.items()}
    ours = rows["omrl-search"]["overhead_us_per_node"]
    for r in rows.values():
        r["overhead_ratio_to_omrl"] = round(r["overhead_us_per_node"] / ours, 1)
    cols = ("nodes", "children_created", "simulations", "cpu_s", "us_per_node", "env_us_per_node",
            "policy_us_per_node", "overhead_us_per_node", "overhead_us_per_child",
            "overhead_us_per_simulation", "overhead_ratio_to_omrl")
    print(f"Game24 MCTS, {args.tasks} tasks, {args.simulations} simulations, k=3, zero-cost policy, "
          f"fastest of {args.repeat} alternating runs (CPU time); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    print(f"{'':22}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for name, r in rows.items():
        print(f"{name:22}" + "".join(f"{r[c]:>{len(c) + 2}}" for c in cols))
    version = None
    if mcts is None:
        print(f"llm-reasoners side skipped ({note}): {INSTALL}")
    else:
        version = importlib.metadata.version("llm-reasoners")
    print(json.dumps({"benchmark": "engine_overhead_reference", "python": platform.python_version(),
                      "cpus": os.cpu_count(), "tasks": args.tasks, "simulations": args.simulations,
                      "repeat": args.repeat, "load_average": os.getloadavg()[0],
                      "llm_reasoners": version, "reasoners_import": note, **rows}))


if __name__ == "__main__":
    main()
