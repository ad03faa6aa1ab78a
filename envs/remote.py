"""RemoteEnv: the env contract over HTTP, against ``omrl env serve`` or an AgentGym env server.

``remote_factory(url)`` gives the engine an ``env_factory`` (``search_many(...,
env_factory=...)``, ``omrl search --env-server URL``): every search then creates its env on the
server and closes it at the end. Three dialects, named by a prefix on the URL:

* ``http://host:port`` — ``omrl env serve``: tasks are sent whole, state keys come from the env
  itself, and snapshots are native (stored on the server; one call restores one);
* ``agentgym+http://...`` — AgentGym's ``id`` servers (BabyAI, SciWorld, TextCraft):
  ``/create`` answers ``{"id"}``, ``/reset {"id", "data_idx"}``, ``/step {"id", "action"}``;
* ``webshop+http://...`` and ``sqlgym+http://...`` — AgentGym's ``env_idx`` servers: ``/create``
  answers the bare index, ``/reset {"env_idx", "session_id" | "item_id"}``, ``/step`` answers
  ``{"state", "reward", "done", "info"}``.

AgentGym servers reset by index: a task's ``data["data_idx"]`` (see :func:`agentgym_tasks`), or
its position in the local env's task list of its split. They have no snapshots, so restoring
replays the action prefix; their state key hashes the task and the observation, which both
detects a replay that went elsewhere and lets dedup merge equal-looking states. They answer
errors with status 200 and ``{"error": ...}``; every such answer, any 4xx/5xx and every
connection failure or timeout raises :class:`~omrl_search.env.EnvError` (the engine counts it as
a fault of that branch). A remote snapshot is a replay snapshot -- ``(task, actions)``, valid in
any copy of the env, local or remote (so scripted policies can replay it in their own env) --
that also carries the server's snapshot id when there is one.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from omrl_search.env import Env, EnvError, ReplayDivergence, _check_snapshot, env_class, stable_hash
from omrl_search.types import Snapshot, StepResult, Task

DEFAULT_TIMEOUT = 60.0
#: dialect -> (name of the env id field, name of the task index field in /reset)
AGENTGYM_DIALECTS = {"agentgym": ("id", "data_idx"), "webshop": ("env_idx", "session_id"),
                     "sqlgym": ("env_idx", "item_id")}


class RemoteError(EnvError):
    """The server answered an error (``status`` is its HTTP status, 200 for AgentGym's)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RemotePrefix(tuple):
    """A remote snapshot's payload: the tuple ``(task, actions)`` of a replay snapshot, plus
    ``ref``, the id of the same state stored on the server (None when there is none)."""

    ref: str | None

    def __new__(cls, task: Task, actions: tuple[str, ...], ref: str | None = None):
        self = super().__new__(cls, (task, tuple(actions)))
        self.ref = ref
        return self

    def __getnewargs__(self):  # pickling and copying keep ``ref``
        return (self[0], self[1], self.ref)


class Http:
    """One server's HTTP calls, each with a timeout; failures raise EnvError naming the call."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, client: Any = None):
        import httpx

        self.url, self.timeout = url.rstrip("/"), timeout
        self.client = client or httpx.Client(timeout=timeout)
        self._httpx = httpx

    def call(self, method: str, path: str, body: dict | None = None, **params: Any) -> Any:
        what = f"env server {self.url}: {method} {path}"
        try:
            r = self.client.request(method, self.url + path, json=body, params=params or None,
                                    timeout=self.timeout)
        except self._httpx.TimeoutException:
            raise EnvError(f"{what} timed out after {self.timeout:g} s") from None
        except self._httpx.HTTPError as exc:
            raise EnvError(f"{what} failed: {type(exc).__name__}: {exc}") from None
        try:
            data = r.json()
        except ValueError:
            data = None
        message = data.get("error") if isinstance(data, dict) else None
        if r.status_code >= 400:
            detail = message or (data.get("detail") if isinstance(data, dict) else None) or r.text[:200]
            raise RemoteError(f"{what}: HTTP {r.status_code}: {detail}", r.status_code)
        if message:  # AgentGym's servers answer errors with status 200
            raise RemoteError(f"{what}: {message}", r.status_code)
        if data is None and r.content:
            raise EnvError(f"{what}: the answer is not JSON: {r.text[:200]!r}")
        return data


class RemoteEnv(Env):
    """An env on an HTTP server; see the module docstring for the dialects.

    ``action_help``, ``description``, ``examples`` and ``max_steps`` come from the server's
    ``/info`` (omrl) or from the local env class of that name (AgentGym), unless given.
    ``success_score``: an AgentGym episode succeeded when it ends with ``score`` (else summed
    reward) at least this (SciWorld scores up to 100). AgentGym servers give no final answer
    (``info["answer"]``), so strategies that vote on answers have nothing to compare there, and
    only ``done``, read as ``terminated``. An omrl server's ``/step`` answer carries the typed
    ``terminated``, ``truncated``, ``success`` and ``valid`` (older ones: ``done``, and
    ``success``/``valid`` in ``info``, read the same way).
    """

    snapshot_kind = "replay"

    def __init__(self, url: str, env: str, *, dialect: str = "omrl", timeout: float = DEFAULT_TIMEOUT,
                 http: Http | None = None, info: dict[str, Any] | None = None,
                 success_score: float = 1.0, _env_id: Any = None, **about: Any):
        if dialect != "omrl" and dialect not in AGENTGYM_DIALECTS:
            raise ValueError(f"unknown env server dialect {dialect!r} (known: omrl, "
                             f"{', '.join(AGENTGYM_DIALECTS)})")
        self.http = http or Http(url, timeout)
        self.dialect, self.native = dialect, dialect == "omrl"
        self.id_key, self.index_key = AGENTGYM_DIALECTS.get(dialect, ("id", "data_idx"))
        self.success_score = success_score
        if info is None and self.native:
            info = self.http.call("GET", "/info")
        self._describe(env, info or {}, about)
        self._task: Task | None = None
        self._actions: tuple[str, ...] = ()
        self._obs, self._key, self._ref, self._score = "", "", None, 0.0
        self.replays = 0  # restores done by replay (no stored snapshot on the server)
        if _env_id is None:
            made = self.http.call("POST", "/create", {})
            _env_id = made["id"] if isinstance(made, dict) else made
        self.env_id = _env_id

    def _describe(self, env: str, info: dict[str, Any], about: dict[str, Any]) -> None:
        if self.native and info.get("env") != env:
            raise EnvError(f"env server {self.http.url} serves env {info.get('env')!r}, not {env!r}")
        try:
            local: Any = env_class(env)
        except KeyError:
            local = None
        self.name = env
        for attr, default in (("description", ""), ("action_help", ""), ("examples", ""),
                              ("max_steps", 20)):
            value = about.pop(attr, info.get(attr, getattr(local, attr, default)))
            setattr(self, attr, value)
        if about:
            raise TypeError(f"RemoteEnv got unexpected arguments: {', '.join(sorted(about))}")
        if info.get("heuristic"):  # only then: strategies test for the attribute
            self.heuristic = self._heuristic

    # --- episode -------------------------------------------------------------------------------
    def _body(self, **fields: Any) -> dict[str, Any]:
        return {self.id_key: self.env_id, **fields}

    def reset(self, task: Task) -> str:
        if self.native:
            out = self.http.call("POST", "/reset", self._body(task=_task_dict(task), snapshot=True))
            self._obs, self._key, self._ref = out["observation"], out["state_key"], out.get("snapshot_id")
        else:
            out = self.http.call("POST", "/reset", self._body(**{self.index_key: data_idx(task)}))
            obs = out.get("observation") if isinstance(out, dict) else None
            if not isinstance(obs, str):  # env_idx servers answer [observation, None]; ask again
                obs = self.http.call("GET", "/observation", **{self.id_key: self.env_id})
            self._obs, self._ref = str(obs), None
            self._key = stable_hash((task.task_id, self._obs))
        self._task, self._actions, self._score = task, (), 0.0
        return self._obs

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise EnvError("step() before reset()")
        out = self.http.call("POST", "/step", self._body(action=action, snapshot=self.native))
        if not isinstance(out, dict):
            raise EnvError(f"env server {self.http.url}: /step answered {type(out).__name__}, "
                           "not an object")
        reward, done = float(out.get("reward") or 0.0), bool(out.get("done"))
        if self.native:
            obs, info = out["observation"], dict(out.get("info") or {})
            # the typed fields; a server without them sent success/valid in info
            legacy = {k: info.pop(k) for k in ("success", "valid") if k in info}
            success = bool(out.get("success", legacy.get("success", False)))
            valid = bool(out.get("valid", legacy.get("valid", True)))
            self._key, self._ref = out["state_key"], out.get("snapshot_id")
        else:
            obs = str(out["observation"] if "observation" in out else out.get("state", ""))
            self._score = float(out["score"]) if out.get("score") is not None else self._score + reward
            info, valid = {"score": self._score}, True
            success = done and self._score >= self.success_score
            self._key, self._ref = stable_hash((self._task.task_id, obs)), None
        # Gymnasium's two flags when the server sends them; a bare ``done`` counts as terminated
        terminated = bool(out.get("terminated", done and not out.get("truncated")))
        truncated = bool(out.get("truncated", False))
        self._obs, self._actions = obs, self._actions + (action,)
        return StepResult(obs, reward, terminated=terminated, truncated=truncated, info=info,
                          success=success, valid=valid)

    def observe(self) -> str:
        return self._obs

    def state_key(self) -> str:
        return self._key

    def close(self) -> None:
        """Close the env on the server; never raises (a server that is gone expires it anyway)."""
        try:
            self.http.call("POST", "/close", self._body())
        except EnvError:
            pass

    # --- snapshots -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        if self._task is None:
            raise EnvError("snapshot() before reset()")
        if self.native and self._ref is None:
            self._ref = self.http.call("POST", "/snapshot", self._body())["snapshot_id"]
        return Snapshot("replay", RemotePrefix(self._task, self._actions, self._ref), self._key,
                        self._obs, self.name)

    def restore(self, snapshot: Snapshot) -> None:
        """Restore by the server's stored snapshot when it still has it, else by replay."""
        _check_snapshot(self, snapshot, "replay")
        task, actions = snapshot.payload
        ref = getattr(snapshot.payload, "ref", None)
        if self.native and ref is not None:
            try:
                out = self.http.call("POST", "/restore", self._body(snapshot_id=ref))
            except RemoteError as exc:
                if exc.status != 404:  # 404: evicted or its env closed -> replay below
                    raise
            else:
                if out["state_key"] != snapshot.state_key:
                    raise EnvError(f"restored snapshot {ref} has state {out['state_key']}, "
                                   f"expected {snapshot.state_key}")
                self._task, self._actions, self._ref = task, tuple(actions), ref
                self._obs, self._key = out["observation"], out["state_key"]
                return
        self.replays += 1
        self.reset(task)
        for action in actions:
            self.step(action)
        if self._key != snapshot.state_key:
            raise ReplayDivergence(f"replaying {len(actions)} actions of task {task.task_id} on "
                                   f"{self.http.url} reached a different state")

    def fork(self) -> "RemoteEnv":
        """A second env on the server in this env's state (omrl servers only)."""
        if not self.native:
            raise EnvError(f"{self.dialect} servers cannot fork envs")
        out = self.http.call("POST", "/fork", self._body())
        twin = RemoteEnv(self.http.url, self.name, http=self.http, info=self._info(), _env_id=out["id"])
        twin._task, twin._actions = self._task, self._actions
        twin._obs, twin._key = out["observation"], out["state_key"]
        return twin

    def _info(self) -> dict[str, Any]:
        return {"env": self.name, "description": self.description, "action_help": self.action_help,
                "examples": self.examples, "max_steps": self.max_steps,
                "heuristic": hasattr(self, "heuristic")}

    # --- optional parts of the contract --------------------------------------------------------
    def valid_actions(self) -> list[str] | None:
        return self.http.call("GET", "/valid_actions", id=self.env_id) if self.native else None

    def expert_action(self) -> str | None:
        return self.http.call("GET", "/expert_action", id=self.env_id) if self.native else None

    def _heuristic(self) -> float:
        return float(self.http.call("GET", "/heuristic", id=self.env_id))


def _task_dict(task: Task) -> dict[str, Any]:
    return {"env": task.env, "task_id": task.task_id, "split": task.split, "seed": task.seed,
            "instruction": task.instruction, "data": task.data}


def data_idx(task: Task) -> int:
    """The index an AgentGym server resets ``task`` by: ``task.data["data_idx"]``, else the
    task's position in the local env's task list of its split."""
    idx = task.data.get("data_idx")
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    found = _positions(task.env, task.split).get(task.task_id)
    if found is None:
        raise EnvError(f"task {task.task_id!r}: AgentGym servers reset by index; give it as "
                       "task.data['data_idx'] (see envs.remote.agentgym_tasks)")
    return found


@lru_cache(maxsize=16)
def _positions(env: str, split: str) -> dict[str, int]:
    try:
        return {t.task_id: i for i, t in enumerate(env_class(env).tasks(split))}
    except (KeyError, NotImplementedError, ValueError):
        return {}


def agentgym_tasks(env: str, indices, split: str = "test") -> list[Task]:
    """Tasks of an env that exists only on an AgentGym server, by index (``data_idx``)."""
    return [Task(env=env, task_id=f"{env}-{i}", split=split, data={"data_idx": int(i)})
            for i in indices]


def parse_server(spec: str) -> tuple[str, str]:
    """``"webshop+http://h:1"`` -> ``("webshop", "http://h:1")``; a bare URL is an omrl server."""
    head, plus, rest = spec.partition("+")
    dialect, url = (head, rest) if plus and head in AGENTGYM_DIALECTS else ("omrl", spec)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"bad env server {spec!r}: expected [DIALECT+]http://HOST:PORT with DIALECT "
                         f"one of {', '.join(AGENTGYM_DIALECTS)} (none: an omrl env server)")
    return dialect, url


class RemoteFactory:
    """An ``env_factory`` for the engine: ``factory(env_name)`` creates that env on the server.

    Each search holds one env until it ends, so search at most ``max_envs`` (the omrl server's
    cap; None for AgentGym servers) tasks at once (``concurrency=``). Checks at once that the
    server answers (and, for an omrl server, that it serves ``env``), so a wrong URL fails with
    one ``ValueError`` line before any search starts. Picklable: a copy (a Ray actor's) opens
    its own connections.
    """

    def __init__(self, spec: str, env: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 **options: Any):
        self.dialect, self.url = parse_server(spec)
        self.timeout, self.options, self._http = timeout, options, None
        omrl = self.dialect == "omrl"
        try:
            info = self.http.call("GET", "/info" if omrl else "/")
        except EnvError as exc:
            hint = "; for an AgentGym server write agentgym+URL" if omrl else ""
            raise ValueError(f"cannot use env server {self.url}: {exc}{hint}") from None
        if omrl and not (isinstance(info, dict) and "protocol" in info):
            raise ValueError(f"{self.url} is not an omrl env server (its /info has no protocol); "
                             "for an AgentGym server write agentgym+URL")
        if omrl and env is not None and info.get("env") != env:
            raise ValueError(f"env server {self.url} serves env {info.get('env')!r}, not {env!r}")
        self.info = info if omrl else None
        self.max_envs = self.http.call("GET", "/health")["max_envs"] if omrl else None

    @property
    def http(self) -> Http:
        if self._http is None:
            self._http = Http(self.url, self.timeout)
        return self._http

    def __call__(self, name: str) -> RemoteEnv:
        return RemoteEnv(self.url, name, dialect=self.dialect, http=self.http, info=self.info,
                         **self.options)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_http": None}  # connections do not travel


def remote_factory(spec: str, env: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                   **options: Any) -> RemoteFactory:
    """The engine's ``env_factory`` for the server at ``spec`` (``[DIALECT+]URL``); see
    :class:`RemoteFactory`."""
    return RemoteFactory(spec, env, timeout=timeout, **options)
