"""Snapshot cost: what snapshot(), restore() and step() cost in every registered env.

Workload: for each env (all registered ones, or ``--envs a,b``), the first ``--tasks`` test
tasks; on each task the env follows its expert's path for up to ``--depth`` steps, and at every
state on the way it times ``snapshot()``, ``restore(snapshot)`` and ``step(expert action)``
(restoring untimed before each step, so every step starts from the same state), ``--reps`` times
each. A search pays these three calls per node, so they bound how fast any strategy can expand
a tree in that env. The first step at each state is also reported on its own (``first_step``):
an env that memoises pays its full cost only then (though what the untimed ``expert_action()``
call already computed, e.g. webshop's BM25 results for the expert's query, is warm even then).
Envs without an expert step with their first valid action; envs that refuse restores get their
path steps timed once each and no restore figure. ``--replay`` also measures every env with
replay snapshots (reset + the action prefix), whose restore grows with the depth.

    python benchmarks/snapshot_cost.py [--envs game24,webshop] [--tasks 3] [--reps 200] [--replay]

Each call is timed on its own (``time.perf_counter_ns``, the garbage collector off while timing,
as ``timeit`` does) and the figures are medians over all states and tasks, in µs (p90 in the
JSON). A state stops being repeated after ``--max-seconds`` (at least 3 samples), so slow envs
(a database, a Java process) finish too. An env whose optional packages are missing, or that
fails to build or to reset, is skipped with its reason printed.

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable


from omrl_search.env import Env, env_class, list_envs, make_env  # noqa: E402

OPS = ("snapshot", "restore", "step")


def timed(fn: Callable[[], object], reps: int, max_s: float,
          setup: Callable[[], object] | None = None) -> list[int]:
    """Nanoseconds of ``reps`` calls of ``fn`` (``setup`` runs untimed before each), fewer when
    ``max_s`` seconds have passed (at least 3)."""
    out: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(max_s * 1e9)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for i in range(reps):
            if setup is not None:
                setup()
            t0 = clock()
            fn()
            out.append(clock() - t0)
            if i >= 2 and clock() > deadline:
                break
    finally:
        if gc_was_on:
            gc.enable()
    return out


def next_action(env: Env) -> str | None:
    action = env.expert_action()
    if action is None:
        actions = env.valid_actions() or []
        action = actions[0] if actions else None
    return action


def measure(name: str, kind: str | None, tasks: list, args) -> dict:
    """Samples of the three calls along the expert's path of each task, summarised."""
    t0 = time.perf_counter()
    env = make_env(name, snapshots=kind)
    samples: dict[str, list[int]] = {op: [] for op in OPS + ("first_step",)}
    states = 0
    try:
        for task in tasks:
            env.reset(task)
            for _ in range(args.depth):
                action = next_action(env)
                if action is None:
                    break
                snap = env.snapshot()
                samples["snapshot"] += timed(env.snapshot, args.reps, args.max_seconds)
                if env.can_restore:
                    samples["restore"] += timed(lambda: env.restore(snap), args.reps, args.max_seconds)
                    steps = timed(lambda: env.step(action), args.reps, args.max_seconds,
                                  setup=lambda: env.restore(snap))
                    samples["step"] += steps
                    samples["first_step"].append(steps[0])
                    env.restore(snap)
                    result = env.step(action)
                else:
                    t0 = time.perf_counter_ns()
                    result = env.step(action)
                    samples["step"].append(time.perf_counter_ns() - t0)
                    samples["first_step"].append(samples["step"][-1])
                states += 1
                if result.done:
                    break
    finally:
        env.close()
    row: dict = {"kind": env.snapshot_kind, "tasks": len(tasks), "states": states,
                 "samples": len(samples["snapshot"]), "seconds": round(time.perf_counter() - t0, 2)}
    for op, values in samples.items():
        if values:
            values.sort()
            row[f"{op}_us"] = round(statistics.median(values) / 1e3, 2)
            row[f"{op}_p90_us"] = round(values[int(0.9 * (len(values) - 1))] / 1e3, 2)
        else:
            row[f"{op}_us"] = row[f"{op}_p90_us"] = None
    return row


def run_env(name: str, args) -> tuple[list[tuple[str, dict]], str | None]:
    """Rows for ``name`` (its own snapshot kind, and replay with ``--replay``), or a skip reason."""
    try:
        cls = env_class(name)
        tasks = cls.tasks("test", limit=args.tasks)
        if not tasks:
            return [], "no test tasks"
        kinds = [None] + (["replay"] if args.replay and cls.snapshot_kind != "replay" else [])
        return [(name if kind is None else f"{name}/{kind}", measure(name, kind, tasks, args))
                for kind in kinds], None
    except NotImplementedError:
        return [], "no built-in test tasks"
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on to the next env
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [], f"{type(exc).__name__}: {text}"[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default="", help="comma-separated env names (default: all registered)")
    ap.add_argument("--tasks", type=int, default=3, help="test tasks per env")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per state and operation")
    ap.add_argument("--depth", type=int, default=8, help="states timed along each expert path")
    ap.add_argument("--max-seconds", type=float, default=0.5, help="time cap per state and operation")
    ap.add_argument("--replay", action="store_true", help="also measure every env with replay snapshots")
    args = ap.parse_args()
    if min(args.tasks, args.reps, args.depth) < 1:
        ap.error("--tasks, --reps and --depth must be >= 1")
    registered = list_envs()
    names = [n.strip() for n in args.envs.split(",") if n.strip()] or registered
    unknown = [n for n in names if n not in registered]
    if unknown:
        ap.error(f"unknown env(s) {', '.join(unknown)} (registered: {', '.join(registered)})")

    rows: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in names:
        got, reason = run_env(name, args)
        if reason is not None:
            skipped[name] = reason
            print(f"skipping {name}: {reason}", file=sys.stderr, flush=True)
        rows.update(got)

    print(f"snapshot(), restore() and step(expert action) per call, median µs over up to {args.reps} "
          f"reps at each state of the expert path (depth <= {args.depth}) of {args.tasks} test tasks; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    cols = ("kind", "states", "snapshot_us", "restore_us", "step_us", "first_step_us")
    width = max([len(k) for k in rows] + [4])
    print(f"{'env':{width}}" + "".join(f"{c:>14}" for c in cols))
    for key, row in rows.items():
        print(f"{key:{width}}" + "".join(f"{'-' if row[c] is None else row[c]!s:>14}" for c in cols))
    for name, reason in skipped.items():
        print(f"{name:{width}}  skipped: {reason}")
    print(json.dumps({"benchmark": "snapshot_cost", "python": platform.python_version(),
                      "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "tasks": args.tasks,
                      "reps": args.reps, "depth": args.depth, "envs": rows, "skipped": skipped}))


if __name__ == "__main__":
    main()
