"""``omrl env serve`` and RemoteEnv: remote searches equal in-process ones, concurrent clients
stay apart, bad requests get a 4xx and a clear message, the env cap and idle expiry hold, the
AgentGym dialects work against fake AgentGym servers, and the CLI runs a search on a server."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

import omrl_search as om
from envs.remote import RemotePrefix, agentgym_tasks, remote_factory
from envs.server import create_app
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.cli import main
from omrl_search.env import EnvError, env_class, make_env
from omrl_search.types import Task

ROOT = Path(__file__).resolve().parents[1]
ORACLE = "scripted:oracle:p=0.3"


def _tcp_socket() -> socket.socket:
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else ~40 ms a request)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serving(app, **config):
    """Run ``app`` under uvicorn (``config``: more of ``uvicorn.Config``'s arguments) in a
    background thread on a free port; stop it at the end."""
    sock = _tcp_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def urls():
    with serving(create_app("game24")) as g, serving(create_app("countdown")) as c:
        yield {"game24": g, "countdown": c}


def _best_actions(result):
    best = result.best_trajectory
    return [s.action for s in best.steps] if best is not None else None


def _same_searches(local, remote):
    for a, b in zip(local, remote, strict=True):
        assert b.faults == []
        summary = lambda r: (r.success, len(r.tree.nodes), _best_actions(r))  # noqa: E731
        assert summary(b) == summary(a)
        assert b.spent["env_steps"] == a.spent["env_steps"]


# --- a search through RemoteEnv equals the in-process one ---------------------------------------
@pytest.mark.parametrize("env", ["game24", "countdown"])
@pytest.mark.parametrize("strategy", ["mcts", "beam"])
def test_remote_search_equals_in_process(urls, env, strategy):
    tasks = om.load_tasks(env, "test", limit=4)
    local = om.search_many(tasks, strategy=strategy, policy=ORACLE, seed=3)
    remote = om.search_many(tasks, strategy=strategy, policy=ORACLE, seed=3,
                            env_factory=remote_factory(urls[env], env))
    _same_searches(local, remote)
    assert 0 < sum(r.success for r in remote) and sum(len(r.tree.nodes) for r in remote) > 4 * 5
    assert httpx.get(urls[env] + "/health").json()["live_envs"] == 0  # every search closed its env


def test_snapshot_payload_replays_locally_and_pickles(urls):
    import pickle

    task = om.load_tasks("game24", "test", limit=1)[0]
    remote = remote_factory(urls["game24"])("game24")
    remote.reset(task)
    solver = make_env("game24")
    solver.reset(task)
    remote.step(solver.expert_action())
    snap = remote.snapshot()
    assert isinstance(snap.payload, RemotePrefix) and snap.payload.ref
    again = pickle.loads(pickle.dumps(snap.payload))
    assert (tuple(again), again.ref) == (tuple(snap.payload), snap.payload.ref)
    assert again.origin.key == snap.payload.origin.key == (urls["game24"], "game24", "omrl")
    assert not again.origin.remote_only  # registered here: a local copy replays it
    local = make_env("game24", snapshots="replay")  # what a scripted policy does with it
    local.restore(snap)
    assert local.state_key() == snap.state_key and local.observe() == snap.observation
    copy = pickle.loads(pickle.dumps(remote_factory(urls["game24"])))  # e.g. for a Ray actor
    other = copy("game24")
    other.restore(snap)  # another env cannot use the stored snapshot (404): it replays
    assert (other.observe(), other.state_key(), other.replays) == (snap.observation, snap.state_key, 1)
    twin = remote.fork()  # a fork shares its source's snapshots
    twin.step("answer 1 + 1")
    twin.restore(snap)
    assert (twin.observe(), twin.state_key(), twin.replays) == (snap.observation, snap.state_key, 0)
    remote.close()  # frees its stored snapshots: now only a replay gets there
    twin.step("answer 1 + 1")
    twin.restore(snap)
    assert (twin.observe(), twin.state_key(), twin.replays) == (snap.observation, snap.state_key, 1)
    other.close()
    twin.close()


# --- 8 concurrent clients -----------------------------------------------------------------------
def test_eight_concurrent_clients_never_see_each_others_state(urls):
    tasks = om.load_tasks("game24", "test", limit=8)
    factory = remote_factory(urls["game24"], "game24")  # one shared HTTP client, as the engine has
    barrier, errors, steps = threading.Barrier(8), [], [0] * 8

    def client(i: int) -> None:
        try:
            remote, local = factory("game24"), make_env("game24")
            remote.reset(tasks[i])
            local.reset(tasks[i])
            saved = None
            for n in range(3):
                barrier.wait(10)  # all eight step at the same moment
                action = local.expert_action()
                got, want = remote.step(action), local.step(action)
                assert (got.observation, got.done) == (want.observation, want.done)
                assert remote.state_key() == local.state_key()
                steps[i] += 1
                if n == 0:
                    saved, saved_local = remote.snapshot(), local.snapshot()
            barrier.wait(10)
            remote.restore(saved)
            local.restore(saved_local)
            assert (remote.observe(), remote.state_key()) == (local.observe(), local.state_key())
            assert remote.replays == 0  # restored from the server's stored snapshot
            remote.close()
        except Exception as exc:  # noqa: BLE001 - reported below with the client's number
            errors.append(f"client {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and steps == [3] * 8


# --- bad requests -------------------------------------------------------------------------------
def test_bad_requests_get_4xx_with_a_clear_message_and_the_server_keeps_serving(urls):
    url = urls["game24"]
    c = httpx.Client(base_url=url, timeout=10)
    fresh = c.post("/create", json={"first_episode": False}).json()["id"]  # no episode yet
    closed = c.post("/create").json()["id"]
    assert c.post("/close", json={"id": closed}).json() == {"id": closed, "closed": True}
    cases = [
        ("POST", "/step", {"id": 987654, "action": "4 * 6"}, 404, "env 987654 not found"),
        ("POST", "/step", b'{"id": 1, "action": ', 400, "malformed JSON"),
        ("POST", "/step", {"id": "one", "action": "4 * 6"}, 422, "id:"),
        ("POST", "/step", {"id": fresh}, 422, "action: Field required"),
        ("POST", "/step", {"id": fresh, "action": "4 * 6"}, 409, "POST /reset first"),
        ("POST", "/step", {"id": closed, "action": "4 * 6"}, 410, f"env {closed} was closed"),
        ("GET", f"/observation?id={closed}", None, 410, "was closed"),
        ("POST", "/reset", {"id": fresh, "data_idx": -1}, 422, "data_idx must be >= 0"),
        ("POST", "/reset", {"id": fresh, "data_idx": 0, "session_id": 0}, 422, "exactly one of data_idx"),
        ("POST", "/reset", {"id": fresh, "data_idx": 0, "split": "dev"}, 422, "not 'dev'"),
        ("POST", "/reset", {"id": fresh}, 422, "exactly one of data_idx"),
        ("POST", "/reset", {"id": fresh, "task": {"task_id": "t", "data": {}}}, 422, "rejected by env game24"),
        ("POST", "/reset", {"id": fresh, "task": {"env": "countdown", "task_id": "t"}}, 422, "serves 'game24'"),
        ("POST", "/restore", {"id": fresh, "snapshot_id": "s-none"}, 404, "snapshot 's-none' not found"),
        ("GET", "/observation", None, 422, "id: Field required"),
    ]
    for method, path, body, status, needle in cases:
        if isinstance(body, bytes):
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.request(method, path, json=body)
        assert (r.status_code, needle in r.json()["error"]) == (status, True), (path, body, r.text)
    # a finished episode refuses more steps; the env itself works throughout
    out = c.post("/reset", json={"id": fresh, "data_idx": 0}).json()
    assert out["done"] is False and out["task_id"] == om.load_tasks("game24", "test", limit=1)[0].task_id
    end = c.post("/step", json={"id": fresh, "action": "answer 1 + 1"}).json()
    assert (end["done"], end["terminated"], end["success"], end["valid"]) == (True, True, False, True)
    r = c.post("/step", json={"id": fresh, "action": "4 * 6"})
    assert r.status_code == 409 and "is over" in r.json()["error"]
    r = c.get("/heuristic", params={"id": fresh})
    assert r.status_code == 404 and "no heuristic()" in r.json()["error"]
    assert c.get("/health").json()["status"] == "ok"
    c.post("/close", json={"id": fresh})


def test_an_env_that_raises_gets_a_500_and_the_server_keeps_serving():
    app = create_app("game24")
    with serving(app) as url:
        c = httpx.Client(base_url=url, timeout=10)
        broken, fine = (c.post("/create").json()["id"] for _ in range(2))
        for idx in (broken, fine):
            c.post("/reset", json={"id": idx, "data_idx": 0})

        def boom(action):
            raise RuntimeError("boom")

        with app.state.pool.use(broken) as slot:
            slot.env.step = boom
        r = c.post("/step", json={"id": broken, "action": "4 * 6"})
        assert r.status_code == 500 and r.json() == {"error": "env step raised RuntimeError: boom"}
        assert c.post("/step", json={"id": fine, "action": "4 * 6"}).status_code == 200


def test_openapi_schema_lists_every_endpoint(urls):
    schema = httpx.get(urls["game24"] + "/openapi.json").json()
    assert {"/create", "/reset", "/step", "/observation", "/close", "/snapshot", "/restore", "/fork",
            "/health", "/info"} <= set(schema["paths"])
    assert "action" in schema["components"]["schemas"]["StepBody"]["properties"]


# --- caps and expiry ----------------------------------------------------------------------------
def test_env_cap_and_idle_expiry():
    now = [0.0]
    with serving(create_app("game24", max_envs=2, idle_timeout=10, clock=lambda: now[0])) as url:
        c = httpx.Client(base_url=url, timeout=10)
        a, b = (c.post("/create").json()["id"] for _ in range(2))
        r = c.post("/create")
        assert r.status_code == 503 and "env cap reached: 2 live envs" in r.json()["error"]
        now[0] = 5.0
        assert c.post("/reset", json={"id": a, "data_idx": 0}).status_code == 200  # a is in use
        now[0] = 11.0  # b idle for 11 s > 10 s; a for 6 s
        assert c.post("/create").status_code == 200
        r = c.post("/reset", json={"id": b, "data_idx": 0})
        assert r.status_code == 410 and "expired after 10 s idle" in r.json()["error"]
        assert c.post("/step", json={"id": a, "action": "4 * 6"}).status_code == 200
        assert c.get("/health").json()["live_envs"] == 2
        now[0] = 30.0  # every env idle: a use finds it expired
        r = c.post("/step", json={"id": a, "action": "4 * 6"})
        assert r.status_code == 410 and "expired" in r.json()["error"]


def test_evicted_snapshots_restore_by_replay_and_fork_is_independent():
    with serving(create_app("game24", max_snapshots=2)) as url:
        task = om.load_tasks("game24", "test", limit=1)[0]
        local = make_env("game24")
        local.reset(task)
        remote = remote_factory(url)("game24")
        remote.reset(task)
        first = remote.snapshot()  # the root, stored at reset
        for _ in range(2):  # two more stored snapshots evict the root's
            action = local.expert_action()
            local.step(action)
            remote.step(action)
        twin = remote.fork()
        assert (twin.observe(), twin.state_key()) == (remote.observe(), remote.state_key())
        twin.step("answer 1 + 1")
        assert twin.state_key() != remote.state_key()
        assert httpx.get(url + "/observation", params={"id": remote.env_id}).json() == remote.observe()
        remote.restore(first)
        assert remote.replays == 1 and remote.observe() == first.observation
        assert remote.state_key() == first.state_key
        twin.close()
        remote.close()


# --- AgentGym dialects, against fake AgentGym servers -------------------------------------------
def fake_agentgym(env_name: str, dialect: str) -> FastAPI:
    """A tiny AgentGym-style server over one of our envs, in the ``id`` dialect (BabyAI,
    SciWorld, TextCraft) or the ``env_idx`` one (WebShop): errors are 200 {"error"}, no snapshots."""
    app, envs = FastAPI(), {}
    tasks = env_class(env_name).tasks("test")
    key = "id" if dialect == "agentgym" else "env_idx"

    def guarded(fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - AgentGym's way: a 200 carrying the error
            return {"error": f"{type(exc).__name__}: {exc}"}

    @app.get("/")
    def hello():
        return "fake AgentGym server"

    @app.post("/create")
    def create():
        envs[len(envs)] = make_env(env_name)
        return {"id": len(envs) - 1} if key == "id" else len(envs) - 1

    @app.post("/reset")
    def reset(body: dict):
        def go():
            obs = envs[body[key]].reset(tasks[body["data_idx" if key == "id" else "session_id"]])
            return {"observation": obs, "reward": 0, "score": 0, "done": False} if key == "id" else [obs, None]
        return guarded(go)

    @app.post("/step")
    def step(body: dict):
        def go():
            r = envs[body[key]].step(body["action"])
            reward = float(r.success)  # AgentGym envs report success as reward
            if key == "id":
                return {"observation": r.observation, "reward": reward, "score": reward, "done": r.done}
            return {"state": r.observation, "reward": reward, "done": r.done, "info": None}
        return guarded(go)

    @app.get("/observation")
    def observation(request: Request):
        return guarded(lambda: envs[int(request.query_params[key])].observe())

    @app.post("/close")
    def close(body: dict):
        return guarded(lambda: {"closed": envs.pop(body[key]) is not None})

    return app


class PrefixOracle(OraclePolicy):
    """The oracle, reading the state by replaying the snapshot's ``(task, actions)`` without a
    state-key check (AgentGym servers have no state keys of ours to check against)."""

    def _env_for(self, meta):
        task, actions = meta["snapshot"].payload
        env = make_env(task.env)
        env.reset(task)
        for action in actions:
            env.step(action)
        return env


def _indexed(tasks):
    """Copies of ``tasks`` that record their index on the fake server (its own task order)."""
    return [Task(t.env, t.task_id, t.split, t.seed, t.instruction, {**t.data, "data_idx": i})
            for i, t in enumerate(tasks)]


@pytest.mark.parametrize("dialect", ["agentgym", "webshop"])
def test_agentgym_dialects(dialect):
    tasks = _indexed(om.load_tasks("game24", "test", limit=4))
    with serving(fake_agentgym("game24", dialect)) as url:
        factory = remote_factory(f"{dialect}+{url}")
        for strategy in ("react", "mcts", "beam"):
            local = om.search_many(tasks, strategy=strategy, policy=PrefixOracle(0.3), seed=1,
                                   env_factory=lambda name: make_env(name, snapshots="replay"))
            remote = om.search_many(tasks, strategy=strategy, policy=PrefixOracle(0.3), seed=1,
                                    env_factory=factory)
            _same_searches(local, remote)
        # snapshots replay (lazily: at the next step); indices come from data["data_idx"] only
        env = factory("game24")
        by_index = env.reset(agentgym_tasks("game24", [2])[0])
        assert by_index == env.reset(tasks[2]) == make_env("game24").reset(tasks[2])
        with pytest.raises(EnvError, match="cannot tell which task"):  # no position guessing
            env.reset(om.load_tasks("game24", "test", limit=1)[0])
        env.reset(tasks[2])
        root = env.snapshot()
        env.step("answer 1 + 1")
        env.restore(root)
        assert env.observe() == root.observation and env.replays == 0
        assert not env.step("4 * 6").done and env.replays == 1
        with pytest.raises(EnvError, match="IndexError"):  # the server's 200 {"error"} is raised
            env.reset(agentgym_tasks("game24", [10**6])[0])
        env.close()
        with pytest.raises(EnvError, match="KeyError"):
            env.step("4 * 6")


def test_connection_failures_raise_env_errors_and_count_as_faults():
    with serving(create_app("game24")) as url:
        factory = remote_factory(url, "game24")
        env = factory("game24")
    with pytest.raises(EnvError, match="failed: ConnectError"):
        env.reset(om.load_tasks("game24", "test", limit=1)[0])
    env.close()  # never raises
    results = om.search_many(om.load_tasks("game24", "test", limit=2), strategy="react", policy=ORACLE,
                             env_factory=factory)
    assert [r.success for r in results] == [False, False]
    assert all("ConnectError" in r.faults[0] for r in results)
    with pytest.raises(ValueError, match="cannot use env server"):
        remote_factory(url)
    with pytest.raises(ValueError, match="expected"):
        remote_factory("localhost:8000")


# --- the CLI ------------------------------------------------------------------------------------
def _free_port() -> int:
    with _tcp_socket() as sock:
        return sock.getsockname()[1]


def _serve(env: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """An `omrl env serve` subprocess, once its /health answers, and its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "omrl_search.cli", "env", "serve", "--env", env,
                             "--port", str(port), *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1])
        try:
            if httpx.get(url + "/health", timeout=1).json()["status"] == "ok":
                return proc, url
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                _stop(proc)
                raise AssertionError("omrl env serve did not come up") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM (the server's own shutdown), and if it is not gone within ``grace`` seconds,
    SIGKILL; either way the process is waited for, so no zombie is left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.communicate()


def _zombie_or_alive(pid: int) -> str | None:
    """'Z' for a zombie, the state letter of a live process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("env", ["game24", "sciworld"])
def test_server_stop_reaps_itself_and_its_children(env):
    """A stopped server leaves no process, zombie or alive: the sciworld one holds a JVM per env,
    which ScienceWorld's own close never waits for (its server's JVM outlived it, then a zombie)."""
    import psutil

    proc, url = _serve(env)
    try:
        env_id = httpx.post(url + "/create", json={}, timeout=120).json()["id"]
        httpx.post(url + "/reset", json={"id": env_id, "data_idx": 0}, timeout=120).raise_for_status()
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert env != "sciworld" or children, "the sciworld server should hold a JVM"
    finally:
        _stop(proc)
    assert proc.returncode is not None and _zombie_or_alive(proc.pid) is None
    # at once, not after a while: a child still running when the server is gone exits as an
    # orphan, a zombie until PID 1 reaps it (here, seconds later)
    assert {pid: _zombie_or_alive(pid) for pid in children} == dict.fromkeys(children)


def test_cli_serve_then_search_with_env_server(tmp_path, capsys):
    proc, url = _serve("game24", "--max-envs", "2")
    try:
        # 3 tasks on a server capped at 2 envs: the search keeps 2 trees in flight
        args = ["search", "--env", "game24", "--limit", "3", "--strategy", "mcts", "--seed", "2",
                "--no-progress"]
        assert main(args + ["--env-server", url, "--out", str(tmp_path / "remote")]) == 0
        assert main(args + ["--out", str(tmp_path / "local")]) == 0
        remote, local = (json.loads((tmp_path / d / "summary.json").read_text())["mcts"]
                         for d in ("remote", "local"))
        remote.pop("seconds"), local.pop("seconds")
        assert remote == local and remote["faults"] == 0 and remote["env_steps"] > 0
        capsys.readouterr()
        assert main(["search", "--env", "countdown", "--env-server", url, "--no-progress"]) == 2
        assert "serves env 'game24', not 'countdown'" in capsys.readouterr().err
    finally:
        _stop(proc)
    assert proc.returncode is not None and _zombie_or_alive(proc.pid) is None
    assert main(["search", "--env", "game24", "--env-server", url, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot use env server" in err
    assert main(["env", "serve", "--env", "nope"]) == 2
    assert "unknown env 'nope'" in capsys.readouterr().err
