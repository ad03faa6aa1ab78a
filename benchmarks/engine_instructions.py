"""Engine cost per node in machine instructions (callgrind), exact where CPU time is not.

CPU time on a shared 2-core VM moves 10-30% between runs of the same code, more than most engine
changes are worth. Instruction counts do not move: this script re-runs itself under
``valgrind --tool=callgrind`` and counts, per workload, three separate stretches:

* the search (``engine_overhead.measure``'s or ``engine_overhead_reference.measure_reasoners``'s,
  unchanged: same specs, tasks, zero-cost policy and trees);
* the env calls of its trees, replayed on a fresh env by those scripts' own replay code;
* the policy: our engine's and the agent hooks' ``ZeroCostPolicy.generate`` replayed on the
  requests it answered (recorded during the search); the plain llm-reasoners hooks replayed by
  the reference script's hook replay.

The engine's (or library's) count is the search minus the other two: engine + strategy code per
node (and per MCTS simulation). The timing wrappers of the wall-clock benchmarks are taken off
the env and the hooks first, so neither side counts them. Same trees give the same env and policy
counts, so two versions of the engine compare exactly (±0.2% between runs: hash seeds are fixed);
an instruction is not a nanosecond (a cache miss weighs like an add), so this ranks what the
interpreter executes, beside the CPU-time figures, not instead of them.

    python benchmarks/engine_instructions.py [--kinds beam,dfs,mcts] [--tasks 50] [--agent]

Needs valgrind with its headers (``valgrind/callgrind.h``; Debian: ``apt install valgrind``) and a
C compiler: a two-function helper that starts and stops collection is compiled into a temporary
directory. The llm-reasoners rows need it importable (install line in
``engine_overhead_reference.py``); without it only our rows are counted. About 50× slower than
native: ~2 minutes for beam and DFS on 50 tasks, both sides.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = "OMRL_INSTRUCTIONS_DIR"  # set in the run under valgrind: where the helper and dumps live
HELPER = r"""
#include <valgrind/callgrind.h>
void meter_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void meter_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""
@contextmanager
def collector_off():
    """The cyclic collector off for a counted stretch, after a full pass: its phase would move
    the counts by ~10% with what ran before, so it is off on both sides."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Meter:
    """A stand-in for the benchmarks' ``CLOCK``: each call starts or stops counting (one
    callgrind dump per stretch, in order) and reads one more tick each time, so their
    ``t0 = CLOCK() ... CLOCK()`` pairs mark the stretches. Each stretch takes the next name of
    ``names``; ``stretches`` lists the names of the closed ones."""

    def __init__(self, lib):
        self.lib, self.on, self.ticks = lib, False, 0.0  # lib: meter_start(), meter_stop()
        self.names: list[str] = []
        self.stretches: list[str] = []

    def __call__(self) -> float:
        if self.on:
            self.lib.meter_stop()
        else:
            self.stretches.append(self.names.pop(0))
            self.lib.meter_start()
        self.on = not self.on
        self.ticks += 1.0  # a stretch reads as 1 "second" to code that divides by it
        return self.ticks


def child(args) -> None:
    """Runs under callgrind: each side's search and replays, stretch names to ``sides.json``."""
    import engine_overhead as eo
    import engine_overhead_reference as ref
    from envs.game24 import Game24Env

    meter = Meter(ctypes.CDLL(str(Path(os.environ[CHILD]) / "libmeter.so")))
    eo.CLOCK = ref.CLOCK = meter
    eo.timed = lambda method, holder=None: method  # no timing wrappers on either side
    for name in ("reset", "step", "snapshot"):
        setattr(eo.TimedGame24Env, name, getattr(Game24Env, name))
    ref.RefEnv.restore = Game24Env.restore
    asked: list = []
    generate = eo.ZeroCostPolicy.generate

    def recorded(self, requests):
        asked.extend(requests)
        return generate(self, requests)

    eo.ZeroCostPolicy.generate = recorded
    tasks = eo.om.load_tasks("game24", "test", limit=args.tasks)
    algorithm, _ = ref.import_reasoners_mcts()
    import numpy as np

    sides = []
    for kind in args.kinds:
        runs = [("omrl-search", lambda kind=kind: ref.measure_omrl(tasks, args.simulations, kind), True)]
        if algorithm is not None:
            runs.append(("llm-reasoners", lambda kind=kind: ref.measure_reasoners(
                algorithm, tasks, args.simulations, 3, np.mean, kind=kind), False))
            if args.agent:
                runs.append(("llm-reasoners + agent hooks", lambda kind=kind: ref.measure_reasoners(
                    algorithm, tasks, args.simulations, 3, np.mean, agent=True, kind=kind), True))
        for name, run, replay_policy in runs:
            asked.clear()
            with collector_off():
                first, meter.names = len(meter.stretches), ["search", "env", "policy"]
                row = run()  # the search, then the env replay (and the plain hooks' replay)
                if replay_policy:  # the policy's own draws, replayed on the requests it answered
                    meter()
                    generate(eo.ZeroCostPolicy(), list(asked))
                    meter()
            sides.append({"side": name, "kind": kind, "nodes": row["nodes"],
                          "simulations": row["simulations"], "stretches": meter.stretches[first:]})
    Path(os.environ[CHILD], "sides.json").write_text(json.dumps(sides))


def dumps(folder: Path) -> list[int]:
    """Instructions of each stretch, in order (callgrind's ``summary`` of each dump)."""
    files = sorted(folder.glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
    out = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                out.append(int(line.split()[1]))
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="beam,dfs", help="comma-separated, of mcts,beam,dfs")
    ap.add_argument("--tasks", type=int, default=50)
    ap.add_argument("--simulations", type=int, default=200)
    ap.add_argument("--agent", action="store_true", help="also the llm-reasoners + agent hooks rows")
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or any(k not in ("mcts", "beam", "dfs") for k in args.kinds):
        ap.error(f"--kinds: each of mcts, beam, dfs, got {','.join(args.kinds)!r}")
    if os.environ.get(CHILD):
        child(args)
        return
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"engine_instructions: needs {tool} (Debian: apt install valgrind gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "meter.c").write_text(HELPER)
        built = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(folder / "libmeter.so"),
                                str(folder / "meter.c")], capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"engine_instructions: cannot build the callgrind helper: {built.stderr.strip()}")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={folder / 'cg.out'}", sys.executable, __file__, *sys.argv[1:]]
        env = {**os.environ, CHILD: tmp, "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode or not (folder / "sides.json").exists():
            sys.exit(f"engine_instructions: the run under valgrind failed:\n{done.stderr[-3000:]}")
        sides = json.loads((folder / "sides.json").read_text())
        counts = iter(dumps(folder))
    rows = []
    for s in sides:
        part = {name: next(counts) for name in s["stretches"]}
        engine = part["search"] - part["env"] - part.get("policy", 0)
        rows.append({**{k: s[k] for k in ("side", "kind", "nodes", "simulations")},
                     **{f"{k}_instructions": v for k, v in part.items()},
                     "engine_instructions": engine,
                     "engine_k_per_node": round(engine / s["nodes"] / 1000, 1),
                     "engine_k_per_simulation": round(engine / s["simulations"] / 1000, 1)
                     if s["simulations"] else None})
    ours = {r["kind"]: r for r in rows if r["side"] == "omrl-search"}
    print(f"Game24, {args.tasks} tasks, zero-cost policy; thousands of instructions of engine + "
          f"strategy code (library code for llm-reasoners) under callgrind, env and policy replayed")
    print(f"{'':36}{'nodes':>7}{'k instr/node':>14}{'k instr/simulation':>20}{'vs omrl':>9}")
    for r in rows:
        ratio = r["engine_k_per_node"] / ours[r["kind"]]["engine_k_per_node"]
        sim = r["engine_k_per_simulation"]
        print(f"{r['side'] + ' ' + r['kind']:36}{r['nodes']:>7}{r['engine_k_per_node']:>14}"
              f"{sim if sim is not None else '-':>20}{ratio:>9.2f}")
    print(json.dumps({"benchmark": "engine_instructions", "tasks": args.tasks,
                      "simulations": args.simulations, "rows": rows}))


if __name__ == "__main__":
    main()
