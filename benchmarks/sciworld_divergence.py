"""ScienceWorld replay divergence: how often does replaying an action prefix reach another state,
and what does a replay cost next to a step?

Workload: the first ``--tasks`` test tasks of the ``sciworld`` env (default 20: five families x
four variations). Each task gets two action prefixes of at most ``--depth`` steps: the gold path
(until it solves the task) and a random walk (uniform over ScienceWorld's valid action/object
combinations, without ``focus on`` and ``reset task``, which end or reset most tasks). Env A
plays the prefix and snapshots every ``--every`` steps (and at the end); then every snapshot is
restored, deepest first so each restore is a full reload + replay, in env A itself (same JVM) and
in env B (a second JVM). A restore whose state key differs from the one recorded has diverged
(listing order of same-named objects is canonical, so only real state differences count).
Envs A and B never retry (``retries=0``: the raw rate); env C, as configured by default, retries
a divergent replay from a reload, and its row gives the rate of restores that still fail.

Costs are wall-clock (the simulator runs in another process): JVM start, a task load, a step
(with the snapshot's state key), and a full restore per replayed step. The machine's load
average is printed too: on a shared machine absolute times inflate, the ratios hold better.

    python benchmarks/sciworld_divergence.py [--tasks 20] [--depth 20] [--every 4] [--seed 0]

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import defaultdict


from envs.sciworld import SciWorldEnv  # noqa: E402
from omrl_search.env import ReplayDivergence, make_env  # noqa: E402

SKIP = ("focus on", "reset task")
FIELDS = ("observation", "look", "inventory", "goal progress", "score", "completed", "moves")


def view(env) -> tuple:
    """What the state key hashes, field by field (to tell what a divergent replay changed)."""
    return (env.inner.obs,) + env.inner.world()


def gold_prefix(env, depth: int) -> list[str]:
    actions: list[str] = []
    while len(actions) < depth and env.expert_action() is not None:
        actions.append(env.expert_action())
        if env.step(actions[-1]).done:
            break
    return actions


def random_prefix(env, depth: int, rng: random.Random) -> list[str]:
    actions: list[str] = []
    while len(actions) < depth:
        options = sorted(a for a in env.inner.sw.get_valid_action_object_combinations()
                         if not a.startswith(SKIP))
        actions.append(rng.choice(options))
        if env.step(actions[-1]).done:
            break
    return actions


def play(env, task, actions: list[str], every: int, stats) -> list:
    """Replay ``actions`` from a reset, timing steps; ``(snapshot, view)`` every ``every`` steps
    and at the end."""
    t0 = time.perf_counter()
    env.reset(task)
    stats["load_s"].append(time.perf_counter() - t0)
    snaps = []
    for i, action in enumerate(actions, 1):
        t0 = time.perf_counter()
        env.step(action)
        snap = env.snapshot()  # the state key: ScienceWorld's look, inventory, goal progress...
        stats["step_s"].append(time.perf_counter() - t0)
        if i % every == 0 or i == len(actions):
            snaps.append((snap, view(env)))
    return snaps


def restore_all(env, snaps, stats) -> list[tuple[str, ...]]:
    """Restore each snapshot, deepest first (each one a full reload + replay); per snapshot the
    fields that differ (empty: no divergence)."""
    out = []
    for snap, recorded in reversed(snaps):
        depth = len(snap.payload[1])
        t0 = time.perf_counter()
        try:
            env.restore(snap)
            env.sync()  # restores are lazy: replay now
            diff: tuple[str, ...] = ()
        except ReplayDivergence:
            diff = tuple(f for f, x, y in zip(FIELDS, recorded, view(env)) if x != y) or ("other",)
        stats["restore_s_per_step"].append((time.perf_counter() - t0) / depth)
        stats["restore_depth"].append(depth)
        out.append(diff)
    return out[::-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=20)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    tasks = SciWorldEnv.tasks("test", limit=args.tasks)
    stats: dict[str, list[float]] = defaultdict(list)
    t0 = time.perf_counter()
    a, b = make_env("sciworld", retries=0), make_env("sciworld", retries=0)
    c = make_env("sciworld")  # the default: a divergent replay is tried again from a reload
    a.reset(tasks[0])
    stats["jvm_start_s"].append(time.perf_counter() - t0)
    b.reset(tasks[0])
    c.reset(tasks[0])
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # key -> [restores, diverged]
    first_depth: dict[str, list[int | None]] = defaultdict(list)
    fields: dict[str, int] = defaultdict(int)  # field -> divergences where it differed
    for task in tasks:
        family = task.data["task"]
        rng = random.Random(f"{args.seed}:{task.task_id}")
        for kind in ("gold", "random"):
            a.reset(task)
            actions = gold_prefix(a, args.depth) if kind == "gold" else random_prefix(a, args.depth, rng)
            snaps = play(a, task, actions, args.every, stats)
            first = None
            for where, env in (("same", a), ("other", b), ("retries", c)):
                timed = stats if where != "retries" else defaultdict(list)  # raw replays only
                for (snap, _), diff in zip(snaps, restore_all(env, snaps, timed)):
                    if where == "retries":
                        counts[where][0] += 1
                        counts[where][1] += bool(diff)
                        continue
                    for key in ((kind, where), ("family", family), ("all",)):
                        counts[key][0] += 1
                        counts[key][1] += bool(diff)
                    for f in diff:
                        fields[f] += 1
                    if diff:
                        depth = len(snap.payload[1])
                        first = depth if first is None else min(first, depth)
            first_depth[kind].append(first)
    for env in (a, b, c):
        env.close()

    def rate(key) -> float:
        n, d = counts[key]
        return d / n if n else 0.0

    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    step_ms, load_ms = 1000 * mean(stats["step_s"]), 1000 * mean(stats["load_s"])
    per_step_ms = 1000 * mean(stats["restore_s_per_step"])
    depth = mean(stats["restore_depth"])
    print(f"ScienceWorld replay divergence: {len(tasks)} test tasks x (gold, random) prefixes, "
          f"depth <= {args.depth}, snapshot every {args.every} steps; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'restores':<28}{'n':>6}{'diverged':>10}{'rate':>8}")
    rows = [(f"{k} prefix, {w} JVM", (k, w)) for k in ("gold", "random") for w in ("same", "other")]
    rows += [(f"family {f}", ("family", f)) for f in sorted({t.data['task'] for t in tasks})]
    rows += [("all", ("all",)), (f"other JVM, {c.retries} retries", "retries")]
    for label, key in rows:
        n, d = counts[key]
        print(f"{label:<28}{n:>6}{d:>10}{rate(key):>8.1%}")
    for kind in ("gold", "random"):
        firsts = [f for f in first_depth[kind] if f is not None]
        print(f"{kind} prefixes with a divergence: {len(firsts)}/{len(first_depth[kind])}"
              f" (first at depth {sorted(firsts)})")
    print("fields that differed in divergent replays: "
          + ", ".join(f"{f} {n}" for f, n in sorted(fields.items(), key=lambda x: -x[1])))
    print(f"costs: JVM start {mean(stats['jvm_start_s']):.2f} s, task load {load_ms:.0f} ms, "
          f"step + state key {step_ms:.1f} ms; a full restore costs {per_step_ms:.1f} ms per "
          f"replayed step, {per_step_ms * depth:.0f} ms = {per_step_ms * depth / step_ms:.1f} steps "
          f"at the mean depth {depth:.1f}")
    figures = {
        "tasks": len(tasks), "depth": args.depth, "every": args.every, "seed": args.seed,
        "restores": counts[("all",)][0], "diverged": counts[("all",)][1],
        "divergence_rate": rate(("all",)), "retries": c.retries,
        "failed_restore_rate_with_retries": rate("retries"),
        "divergent_tries_with_retries": c.divergences,
        **{f"rate_{k}_{w}": rate((k, w)) for k in ("gold", "random") for w in ("same", "other")},
        "rate_by_family": {f: rate(("family", f)) for f in sorted({t.data['task'] for t in tasks})},
        "prefixes_diverged": {k: sum(f is not None for f in v) for k, v in first_depth.items()},
        "fields_differing": dict(fields),
        "jvm_start_s": mean(stats["jvm_start_s"]), "load_ms": load_ms, "step_ms": step_ms,
        "restore_ms_per_replayed_step": per_step_ms, "mean_restore_depth": depth,
        "restore_over_step_at_mean_depth": per_step_ms * depth / step_ms,
        "loadavg": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
