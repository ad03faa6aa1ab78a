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

``--limits`` measures the server's guards instead (docs/reliability.md): a 1 GiB request body
(declared, and chunked) -- the answer, how much of it was sent, how long it took, and the
server's resident memory before and at its peak while the body was offered; a Game24 task of
3,000 numbers on ``/reset``; and (when bubblewrap is installed) an ``os`` env step running
``sleep 8`` on a server with ``--call-timeout 1``. ``--server-path DIR`` runs the server from
another checkout (e.g. an older commit's ``git archive``) to compare.
"""
from __future__ import annotations

import argparse
import itertools
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

import httpx  # noqa: E402

import omrl_search as om  # noqa: E402
from envs.remote import remote_factory  # noqa: E402
from omrl_search.env import make_env  # noqa: E402


def start_server(env: str, *flags: str, path: str | None = None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = {**os.environ, "PYTHONPATH": path} if path else None
    proc = subprocess.Popen([sys.executable, "-m", "omrl_search.cli", "env", "serve", "--env", env,
                             "--port", str(port), *flags], cwd=path or ROOT,
                            stdout=subprocess.DEVNULL, env=environ)
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


# --- --limits ----------------------------------------------------------------------------------
def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def offer_body(url: str, pid: int, size: int, chunked: bool) -> dict:
    """POST /step with a ``size``-byte body, sent in 1 MiB pieces until the server answers or
    stops reading; the answer's status, bytes sent, seconds, and the server's RSS (MiB)."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head, tail, mib = b'{"id": 0, "action": "', b'"}', 2**20
    filler = size - len(head) - len(tail)  # one JSON string of `size` bytes in all
    pieces = itertools.chain([head], itertools.repeat(b"x" * mib, filler // mib),
                             [b"x" * (filler % mib), tail], [b""] if chunked else [])
    frame = (lambda p: b"%x\r\n%s\r\n" % (len(p), p)) if chunked else (lambda p: p)
    peak, stop = [rss_mb(pid)], threading.Event()
    before = peak[0]

    def sample() -> None:
        while not stop.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    sent, answer, t0 = 0, b"", time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(f"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"{framing}\r\n\r\n".encode())
        sock.setblocking(False)
        pending = memoryview(frame(next(pieces)))
        while True:
            try:
                answer = sock.recv(65536)
                break
            except BlockingIOError:
                pass
            try:
                n = sock.send(pending)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            sent, pending = sent + n, pending[n:]
            if not pending:
                piece = next(pieces, None)
                if piece is None:
                    break
                pending = memoryview(frame(piece))
        sock.settimeout(120)
        try:
            while not answer.rstrip().endswith(b"}"):
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
        except (ConnectionResetError, TimeoutError):
            pass
    seconds = time.perf_counter() - t0
    time.sleep(0.3)
    stop.set()
    sampler.join()
    status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else None
    return {"status": status, "sent_mb": round(sent / 2**20, 1), "seconds": round(seconds, 3),
            "rss_mb_before": round(before, 1), "rss_mb_peak": round(max(peak), 1),
            "rss_mb_after": round(rss_mb(pid), 1)}


def limits(args) -> None:
    out: dict = {"benchmark": "env_server_limits", "server_path": args.server_path or "."}
    proc, url = start_server("game24", path=args.server_path)
    try:
        for chunked in (False, True):
            key = "body_1gib_chunked" if chunked else "body_1gib_declared"
            out[key] = offer_body(url, proc.pid, 2**30, chunked)
        with httpx.Client(base_url=url, timeout=300) as c:
            idx = c.post("/create").json()["id"]
            task = {"env": "game24", "task_id": "big", "split": "test",
                    "data": {"numbers": list(range(1, 3001)), "target": 24}}
            t0 = time.perf_counter()
            r = c.post("/reset", json={"id": idx, "task": task})
            out["task_3000_numbers"] = {"status": r.status_code,
                                        "ms": round((time.perf_counter() - t0) * 1e3, 1),
                                        "answer": r.text[:120]}
        out["rss_mb_end"] = round(rss_mb(proc.pid), 1)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
    if os.path.exists("/usr/bin/bwrap") and not args.server_path:
        proc, url = start_server("os", "--call-timeout", "1")
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                idx = c.post("/create").json()["id"]
                c.post("/reset", json={"id": idx, "data_idx": 0})
                t0 = time.perf_counter()
                r = c.post("/step", json={"id": idx, "action": "bash: sleep 8"})
                took = time.perf_counter() - t0
                late = c.get("/health").json()["calls_past_limit"]
                again = c.post("/step", json={"id": idx, "action": "bash: true"}).status_code
                time.sleep(9)
                out["slow_os_step"] = {"status": r.status_code, "seconds": round(took, 3),
                                       "then": again, "calls_past_limit": late,
                                       "calls_past_limit_9s_later": c.get("/health").json()
                                       ["calls_past_limit"], "answer": r.text[:160]}
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(20)
    for key, value in out.items():
        print(f"{key:22} {value}")
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limits", action="store_true", help="measure the server's guards instead")
    ap.add_argument("--server-path", default=None, help="run the server from this checkout")
    args = ap.parse_args()
    if args.limits:
        return limits(args)
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    proc, url = start_server("game24", path=args.server_path)
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
