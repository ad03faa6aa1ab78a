"""Env server overhead: what stepping an env over HTTP (``omrl env serve`` + RemoteEnv) costs
against stepping it in-process.

Workload, on Game24 test tasks, with the server started as ``omrl env serve`` in its own process
on 127.0.0.1 (so client and server do not share a GIL, as in real use):

* **cycle** -- the engine's env work per new node: ``restore(parent)``, ``step(action)``,
  ``snapshot()``; RemoteEnv does it in 2 HTTP calls (``/restore``, and ``/step`` that stores the
  snapshot in the same call). Microseconds per cycle, median of ``--repeat`` runs.
* **request** -- one ``GET /health`` round trip (the floor of any call).
* **search** -- MCTS with the scripted oracle (p=0.3) on ``--tasks`` tasks, wall seconds
  in-process and remote; the two must give the same trees (checked).
* **8 clients** -- eight threads, each with its own env, doing cycles at once: cycles per second
  in total, against one client.

Wall time (``time.perf_counter``): the remote share is spent in the server process. On a shared
machine wall times move with the load; so the remote cycle is also given as CPU time, the
client's (``time.process_time``) and the server's (``/proc/PID/stat``, Linux), which move less.

    python benchmarks/env_server.py [--tasks 8] [--cycles 300] [--repeat 3]

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

import omrl_search as om  # noqa: E402
from envs.remote import remote_factory  # noqa: E402
from omrl_search.env import make_env  # noqa: E402


def start_server(env: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "omrl_search.cli", "env", "serve", "--env", env,
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("omrl env serve did not start")
            time.sleep(0.2)


def cycles(env, task, n: int) -> float:
    """Seconds per restore + step + snapshot, stepping the expert's first action from the root."""
    env.reset(task)
    root = env.snapshot()
    solver = make_env(task.env)
    solver.reset(task)
    move = solver.expert_action()
    t0 = time.perf_counter()
    for _ in range(n):
        env.restore(root)
        env.step(move)
        env.snapshot()
    return (time.perf_counter() - t0) / n


def parallel(factory, tasks, n: int, clients: int) -> float:
    """Cycles per second in total with ``clients`` threads, each with its own env."""
    envs = [factory(tasks[i % len(tasks)].env) for i in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def work(i: int) -> None:
        barrier.wait()
        cycles(envs[i], tasks[i % len(tasks)], n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for e in envs:
        e.close()
    return clients * n / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    proc, url = start_server("game24")
    try:
        factory = remote_factory(url, "game24")
        med = lambda f: statistics.median(f() for _ in range(args.repeat))  # noqa: E731
        local_cycle = med(lambda: cycles(make_env("game24"), tasks[0], args.cycles))
        remote = factory("game24")
        remote_cycle = med(lambda: cycles(remote, tasks[0], args.cycles))
        server0, client0 = cpu_seconds(proc.pid), time.process_time()
        cycles(remote, tasks[0], args.cycles)
        server_cpu = (cpu_seconds(proc.pid) - server0) / args.cycles
        client_cpu = (time.process_time() - client0) / args.cycles
        remote.close()
        client = httpx.Client()
        request = med(lambda: _timed(lambda: client.get(url + "/health"), args.cycles))

        def search(env_factory):
            t0 = time.perf_counter()
            rs = om.search_many(tasks, strategy="mcts", policy="scripted:oracle:p=0.3", seed=0,
                                env_factory=env_factory)
            return time.perf_counter() - t0, [(r.success, len(r.tree.nodes)) for r in rs]

        local_s, local_trees = search(None)
        remote_s, remote_trees = search(factory)
        assert local_trees == remote_trees, "remote search differs from in-process"
        nodes = sum(n for _, n in local_trees)
        one = parallel(factory, tasks, args.cycles, 1)
        eight = parallel(factory, tasks, args.cycles // 2, 8)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)

    rows = [("cycle (restore+step+snapshot)", f"{local_cycle * 1e6:.0f} µs", f"{remote_cycle * 1e6:.0f} µs"),
            ("  of which client CPU / server CPU", "-", f"{client_cpu * 1e6:.0f} / {server_cpu * 1e6:.0f} µs"),
            ("GET /health round trip", "-", f"{request * 1e6:.0f} µs"),
            (f"MCTS, {len(tasks)} tasks, {nodes} nodes", f"{local_s:.2f} s", f"{remote_s:.2f} s"),
            ("cycles/s, 1 client", "-", f"{one:.0f}"),
            ("cycles/s, 8 clients", "-", f"{eight:.0f}")]
    print(f"Game24 env over HTTP vs in-process; {os.cpu_count()} CPUs, Python {platform.python_version()}")
    for row in [("", "in-process", "remote")] + rows:
        print(f"{row[0]:38}{row[1]:>12}{row[2]:>18}")
    print(json.dumps({"benchmark": "env_server", "python": platform.python_version(), "cpus": os.cpu_count(),
                      "tasks": len(tasks), "cycle_us_local": round(local_cycle * 1e6, 1),
                      "cycle_us_remote": round(remote_cycle * 1e6, 1),
                      "cycle_client_cpu_us": round(client_cpu * 1e6, 1),
                      "cycle_server_cpu_us": round(server_cpu * 1e6, 1),
                      "request_us": round(request * 1e6, 1), "mcts_nodes": nodes,
                      "mcts_s_local": round(local_s, 3), "mcts_s_remote": round(remote_s, 3),
                      "cycles_per_s_1_client": round(one, 1), "cycles_per_s_8_clients": round(eight, 1),
                      "same_trees": local_trees == remote_trees}))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()
