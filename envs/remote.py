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

An AgentGym server's ``GET /`` says which env it serves ("This is environment BabyAI."), and
that env's :class:`~envs._agentgym.Profile` decides: success (by the env's own rule, the default:
BabyAI a positive reward at the end, SciWorld score 100, TextCraft and WebShop reward 1; or by
AgentGym's evaluation, a final reward of exactly 1 or 100: ``success_rule``), the
task description a reset carries apart (SciWorld's ``task_description`` becomes the task's
instruction when it has none), the observation as state keys see it (SciWorld's listings
sorted), the actions the server lists (BabyAI's ``Available actions``, WebShop's
``/available_actions``) and which of its tasks a local task is: ``data["data_idx"]`` (see
:func:`agentgym_tasks`), a bundled babyai task of one of AgentGym's BabyAI levels, a sciworld
task by its place in AgentGym's SciWorld list, or a task of the env an ``omrl env serve`` serves
by its position in its split; any other task is refused (one EnvError line), and
:meth:`RemoteFactory.check_tasks` refuses a whole task list before a search starts. A reset
whose answer names another task (SciWorld's task name, BabyAI's goal) raises EnvError.

AgentGym servers have no snapshots, so restoring replays the action prefix, lazily: the state
is known from the snapshot at once and the server catches up at the next step (only the missing
actions when the snapshot extends the env's episode). Their state key hashes the task and the
normalised observation, which both detects a replay that went elsewhere and lets dedup merge
equal-looking states. They answer errors with status 200 and ``{"error": ...}``; every such
answer, any 4xx/5xx and every connection failure or timeout raises
:class:`~omrl_search.env.EnvError` (the engine counts it as a fault of that branch). A remote
snapshot is a replay snapshot -- ``(task, actions)``, valid in any copy of the env -- that also
carries the server's snapshot id when there is one and its ``origin``, from which a scripted
policy opens an env on the same server to read the state's listed actions.

Every request carries ``Authorization: Bearer TOKEN`` when a token is given (``token=``, else
``$OMRL_ENV_SERVER_TOKEN``), as ``omrl env serve --token`` requires.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from omrl_search.env import Env, EnvError, ReplayDivergence, check_snapshot, env_class, stable_hash
from omrl_search.types import Snapshot, StepResult, Task

from ._agentgym import SUCCESS_RULES, Profile, identify

DEFAULT_TIMEOUT = 60.0
TOKEN_VAR = "OMRL_ENV_SERVER_TOKEN"  # the bearer token, when no token= is given
RETRIES = 3  # replays on an AgentGym server tried again after a divergence
#: dialect -> (name of the env id field, name of the task index field in /reset)
AGENTGYM_DIALECTS = {"agentgym": ("id", "data_idx"), "webshop": ("env_idx", "session_id"),
                     "sqlgym": ("env_idx", "item_id")}


class RemoteError(EnvError):
    """The server answered an error (``status`` is its HTTP status, 200 for AgentGym's)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Origin:
    """Where a remote env lives: enough to open another env of the same name on the same
    server (what a scripted policy acts on). The token stays out of its repr."""

    def __init__(self, url: str, env: str, dialect: str, timeout: float, token: str | None,
                 options: dict[str, Any]):
        self.url, self.env, self.dialect, self.timeout = url, env, dialect, timeout
        self._token, self._options = token, options
        self.key = (url, env, dialect)

    @property
    def remote_only(self) -> bool:
        """Whether only an env on the server can stand for its states: an AgentGym server's
        states are its own, and an env not registered here has no local copy."""
        return self.dialect != "omrl" or not _registered(self.env)

    def open(self) -> "RemoteEnv":
        return RemoteEnv(self.url, self.env, dialect=self.dialect, timeout=self.timeout,
                         token=self._token, **self._options)

    def __repr__(self) -> str:
        return f"Origin({self.dialect}+{self.url}, env={self.env!r})"


class RemotePrefix(tuple):
    """A remote snapshot's payload: the tuple ``(task, actions)`` of a replay snapshot, plus
    ``ref``, the id of the same state stored on the server (None when there is none), and
    ``origin``, the :class:`Origin` of the env that took it."""

    ref: str | None
    origin: Origin | None

    def __new__(cls, task: Task, actions: tuple[str, ...], ref: str | None = None,
                origin: Origin | None = None):
        self = super().__new__(cls, (task, tuple(actions)))
        self.ref, self.origin = ref, origin
        return self

    def __getnewargs__(self):  # pickling and copying keep ``ref`` and ``origin``
        return (self[0], self[1], self.ref, self.origin)


class Http:
    """One server's HTTP calls, each with a timeout; failures raise EnvError naming the call.
    ``token`` (default ``$OMRL_ENV_SERVER_TOKEN``): sent as ``Authorization: Bearer TOKEN``."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, client: Any = None,
                 token: str | None = None):
        import httpx

        self.url, self.timeout = url.rstrip("/"), timeout
        self.token = token if token is not None else os.environ.get(TOKEN_VAR) or None
        self.headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        self.client = client or httpx.Client(timeout=timeout)
        self._httpx = httpx

    def call(self, method: str, path: str, body: dict | None = None, **params: Any) -> Any:
        what = f"env server {self.url}: {method} {path}"
        try:
            r = self.client.request(method, self.url + path, json=body, params=params or None,
                                    headers=self.headers, timeout=self.timeout)
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
    ``profile``: the AgentGym server's :class:`~envs._agentgym.Profile` (default: asked from its
    ``GET /``). ``success_rule``: how an AgentGym server's episode counts as a success,
    ``"env"`` (the default: the env's own rule, e.g. BabyAI's positive final reward) or
    ``"agentgym"`` (AgentGym's evaluation: a final reward of exactly 1 or 100, which no BabyAI
    episode reaches); each step's ``info`` carries both verdicts (``success_env``,
    ``success_agentgym``) whichever decides. ``success_score``: when given, an AgentGym episode
    succeeded when it ends with ``score`` (else summed reward) at least this, instead. AgentGym
    servers give no final answer (``info["answer"]``), so strategies that vote on answers have
    nothing to compare there, and only ``done``, read as ``terminated``. An omrl server's
    ``/step`` answer carries the typed ``terminated``, ``truncated``, ``success`` and ``valid``
    (older ones: ``done``, and ``success``/``valid`` in ``info``, read the same way).
    """

    snapshot_kind = "replay"

    def __init__(self, url: str, env: str, *, dialect: str = "omrl", timeout: float = DEFAULT_TIMEOUT,
                 http: Http | None = None, info: dict[str, Any] | None = None,
                 success_score: float | None = None, success_rule: str = "env",
                 profile: Profile | None = None,
                 token: str | None = None, retries: int = RETRIES, _env_id: Any = None, **about: Any):
        if dialect != "omrl" and dialect not in AGENTGYM_DIALECTS:
            raise ValueError(f"unknown env server dialect {dialect!r} (known: omrl, "
                             f"{', '.join(AGENTGYM_DIALECTS)})")
        self.http = http or Http(url, timeout, token=token)
        self.dialect, self.native = dialect, dialect == "omrl"
        self.id_key, self.index_key = AGENTGYM_DIALECTS.get(dialect, ("id", "data_idx"))
        if success_rule not in SUCCESS_RULES:
            raise ValueError(f"success_rule must be one of {', '.join(SUCCESS_RULES)}, got {success_rule!r}")
        self.success_score, self.success_rule = success_score, success_rule
        if info is None and self.native:
            info = self.http.call("GET", "/info")
        if profile is None and not self.native:
            try:
                profile = identify(self.http.call("GET", "/"))
            except EnvError:
                profile = Profile(None)
        self.profile = profile or Profile(None)
        self.origin = Origin(self.http.url, env, dialect, getattr(self.http, "timeout", timeout),
                             getattr(self.http, "token", token),
                             {"info": info, "profile": profile, "success_score": success_score,
                              "success_rule": success_rule,
                              "retries": retries, **about})
        self._describe(env, info or {}, dict(about))
        self._task: Task | None = None
        self._actions: tuple[str, ...] = ()
        self._obs, self._key, self._ref, self._score = "", "", None, 0.0
        self._dedup = ""  # the server's dedup key for this state ("" when it sends none)
        self._pending: Snapshot | None = None  # restored, not yet replayed (AgentGym servers)
        self.replays = 0  # restores done by replay (no stored snapshot on the server)
        self.divergences = 0  # replays that reached another state (then tried again)
        self.retries = retries
        self._env_id = _env_id

    @property
    def env_id(self) -> Any:
        """The env's id on the server, created at first need (a policy's env may never need it)."""
        if self._env_id is None:
            made = self.http.call("POST", "/create", {"first_episode": False})  # others ignore it
            self._env_id = made["id"] if isinstance(made, dict) else made
        return self._env_id

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
        self._pending = None
        if self.native:
            out = self.http.call("POST", "/reset", self._body(task=_task_dict(task), snapshot=True))
            self.adopt(task, (), out, out.get("snapshot_id"))
        else:
            self._obs, self._ref = self._reset_agentgym(task), None
            self._key, self._dedup = self._state_key(task, self._obs), ""
            self._task, self._actions = task, ()
        self._score = 0.0
        return self._obs

    def _reset_agentgym(self, task: Task) -> str:
        idx = self.profile.index(task)
        if idx is None:
            raise EnvError(f"task {task.task_id!r} of env {task.env!r}: {self._unmatched()}")
        body = self._body(**{self.index_key: idx})
        if self.profile.ours:
            body["split"] = task.split  # our server indexes the split's own list
        out = self.http.call("POST", "/reset", body)
        obs = out.get("observation") if isinstance(out, dict) else None
        if not isinstance(obs, str):  # env_idx servers answer [observation, None]; ask again
            obs = self.http.call("GET", "/observation", **{self.id_key: self.env_id})
        obs = str(obs)
        wrong = self.profile.check(task, out, obs)
        if wrong:
            raise EnvError(f"task {task.task_id!r} is not data_idx {idx} of {self.http.url}: {wrong}")
        if not task.instruction:  # the task description reaches the policy as the instruction
            task.instruction = self.profile.instruction(out)
            if not task.instruction and self.profile.name == "WebShop":
                text = self.http.call("GET", "/instruction_text", **{self.id_key: self.env_id})
                task.instruction = str(text).strip().removeprefix("Instruction:").strip()
        return obs

    def _unmatched(self) -> str:
        server = self.profile.name or "an AgentGym server"
        return (f"cannot tell which task of {self.http.url} ({server}) it is; give its index "
                "as task.data['data_idx'] (see envs.remote.agentgym_tasks)")

    def _state_key(self, task: Task, obs: str) -> str:
        return stable_hash((task.task_id, self.profile.normalise(obs)))

    def step(self, action: str) -> StepResult:
        self._sync()
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
            self._dedup = out.get("dedup_key") or ""
        else:
            obs = str(out["observation"] if "observation" in out else out.get("state", ""))
            self._score = float(out["score"]) if out.get("score") is not None else self._score + reward
            verdicts = {f"success_{rule}": self.profile.success(reward, self._score, done, rule)
                        for rule in SUCCESS_RULES}
            info, valid = {"score": self._score, **verdicts}, True
            if self.success_score is not None:
                success = done and self._score >= self.success_score
            elif isinstance(out.get("success"), bool):  # an omrl server in AgentGym's dialect
                success = out["success"]
            else:
                success = verdicts[f"success_{self.success_rule}"]
            self._key, self._ref, self._dedup = self._state_key(self._task, obs), None, ""
        # Gymnasium's two flags when the server sends them; a bare ``done`` counts as terminated
        terminated = bool(out.get("terminated", done and not out.get("truncated")))
        truncated = bool(out.get("truncated", False))
        self._obs, self._actions = obs, self._actions + (action,)
        return StepResult(obs, reward, terminated=terminated, truncated=truncated, info=info,
                          success=success, valid=valid)

    def observe(self) -> str:
        return self._pending.observation if self._pending else self._obs

    def state_key(self) -> str:
        return self._pending.state_key if self._pending else self._key

    def dedup_key(self) -> str:
        """The served env's own dedup key when its server sends one, else the state key."""
        if self._pending:
            return self._pending.dedup_key or self._pending.state_key
        return self._dedup or self._key

    def close(self) -> None:
        """Close the env on the server; never raises (a server that is gone expires it anyway)."""
        if self._env_id is None:
            return
        try:
            self.http.call("POST", "/close", self._body())
        except EnvError:
            pass

    # --- snapshots -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        if self._pending is not None:
            return self._pending
        if self._task is None:
            raise EnvError("snapshot() before reset()")
        if self.native and self._ref is None:
            self._ref = self.http.call("POST", "/snapshot", self._body())["snapshot_id"]
        return Snapshot("replay", RemotePrefix(self._task, self._actions, self._ref, self.origin),
                        self._key, self._obs, self.name, self._dedup)

    def restore(self, snapshot: Snapshot) -> None:
        """Restore by the server's stored snapshot when it still has it, else by replay (on an
        AgentGym server lazily: at the next step, or when the server must be asked)."""
        check_snapshot(self, snapshot, "replay")
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
                self.adopt(task, actions, out, ref)
                return
        self._pending = snapshot
        if self.native:
            self._sync()

    def _sync(self) -> None:
        """Replay a pending restore: only the missing actions when it extends this env's
        episode, else from a reset. A replay reaching another state is tried again from a
        reset ``retries`` times on an AgentGym server (a simulator such as ScienceWorld's is not
        fully deterministic), then raises ReplayDivergence."""
        snap, self._pending = self._pending, None
        if snap is None or (snap.state_key == self._key and snap.payload[0] is self._task
                            and tuple(snap.payload[1]) == self._actions):
            return
        task, actions = snap.payload
        done = len(self._actions)
        fresh = task is not self._task or tuple(actions[:done]) != self._actions or self.native
        for _ in range(1 + (0 if self.native else self.retries)):
            if fresh:
                self.replays += 1
                self.reset(task)
                done = 0
            for action in actions[done:]:
                self.step(action)
            if self._key == snap.state_key:
                return
            self.divergences += 1
            fresh = True
        raise ReplayDivergence(f"replaying {len(actions)} actions of task {task.task_id} on "
                               f"{self.http.url} reached a different state")

    def fork(self) -> "RemoteEnv":
        """A second env on the server in this env's state (omrl servers only)."""
        if not self.native:
            raise EnvError(f"{self.dialect} servers cannot fork envs")
        out = self.http.call("POST", "/fork", self._body())
        twin = RemoteEnv(self.http.url, self.name, http=self.http, info=self._info(), _env_id=out["id"])
        twin.adopt(self._task, self._actions, out)
        return twin

    def adopt(self, task: Task | None, actions: Sequence[str], out: dict[str, Any],
              ref: str | None = None) -> None:
        """Take the state an omrl server's reply ``out`` reports (its observation, state key and
        dedup key), reached from ``task`` by ``actions`` and stored on the server as ``ref``
        (None: not stored): what reset, restore and a fork's twin each learn from the server."""
        self._task, self._actions, self._ref = task, tuple(actions), ref
        self._obs, self._key = out["observation"], out["state_key"]
        self._dedup = out.get("dedup_key") or ""

    def _info(self) -> dict[str, Any]:
        return {"env": self.name, "description": self.description, "action_help": self.action_help,
                "examples": self.examples, "max_steps": self.max_steps,
                "heuristic": hasattr(self, "heuristic")}

    # --- optional parts of the contract --------------------------------------------------------
    def valid_actions(self) -> list[str] | None:
        """The actions the server lists: an omrl server's ``/valid_actions``; on an AgentGym
        server those its observation names (BabyAI, from the snapshot alone when restored) or
        WebShop's ``/available_actions`` (its clickables, and a search by the task's
        instruction where the page has a search bar); None where the server lists none."""
        if self.native:
            return self.http.call("GET", "/valid_actions", id=self.env_id)
        if self._task is None and self._pending is None:
            raise EnvError("valid_actions() before reset()")
        listed = self.profile.listed_actions(self.observe())
        if listed is not None or self.profile.name != "WebShop":
            return listed
        self._sync()
        out = self.http.call("GET", "/available_actions", **{self.id_key: self.env_id})
        clicks = [f"click[{c}]" for c in out.get("clickables", []) if c != "search"]
        search = [f"search[{self._task.instruction}]"] if out.get("has_search_bar") and self._task.instruction else []
        return search + clicks

    @property
    def lists_actions(self) -> bool:
        """Whether the server names the actions of a state (an omrl server's /valid_actions,
        BabyAI's observations, WebShop's /available_actions); SciWorld and TextCraft do not."""
        return (self.native or self.profile.name == "WebShop"
                or self.profile.listed_actions(self.observe()) is not None)

    def expert_action(self) -> str | None:
        return self.http.call("GET", "/expert_action", id=self.env_id) if self.native else None

    def _heuristic(self) -> float:
        return float(self.http.call("GET", "/heuristic", id=self.env_id))


def _task_dict(task: Task) -> dict[str, Any]:
    return {"env": task.env, "task_id": task.task_id, "split": task.split, "seed": task.seed,
            "instruction": task.instruction, "data": task.data}


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
    server answers (and, for an omrl server, that it serves ``env``; for an AgentGym server
    and a locally registered ``env``, that local tasks can be matched to its tasks by identity),
    so a wrong URL or pairing fails with one ``ValueError`` line before any search starts.
    ``token`` (default ``$OMRL_ENV_SERVER_TOKEN``) is sent as a bearer token. Picklable: a copy
    (a Ray actor's) opens its own connections.
    """

    def __init__(self, spec: str, env: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None, **options: Any):
        self.dialect, self.url = parse_server(spec)
        self.timeout, self.token, self.options, self._http = timeout, token, options, None
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
        self.profile = None if omrl else identify(info)
        if not omrl and env is not None and _registered(env) and not self.profile.matches(env):
            server = self.profile.name or "an AgentGym server of unknown kind"
            raise ValueError(f"env server {self.url} is {server}: local {env} tasks cannot be matched "
                             f"to its tasks by identity; search tasks that carry its data_idx "
                             f"(envs.remote.agentgym_tasks) from Python instead")
        self.max_envs = self.http.call("GET", "/health")["max_envs"] if omrl else None

    @property
    def http(self) -> Http:
        if self._http is None:
            self._http = Http(self.url, self.timeout, token=self.token)
        return self._http

    def check_tasks(self, tasks) -> None:
        """One ``ValueError`` line unless every task can be matched to the AgentGym server's
        task by identity (omrl servers take tasks whole: nothing to check)."""
        if self.profile is None:
            return
        missing = [t.task_id for t in tasks if self.profile.index(t) is None]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            server = self.profile.name or "an AgentGym server"
            raise ValueError(f"{len(missing)} of {len(tasks)} tasks have no task on {self.url} "
                             f"({server}) matched by identity: {shown}")

    def __call__(self, name: str) -> RemoteEnv:
        return RemoteEnv(self.url, name, dialect=self.dialect, http=self.http, info=self.info,
                         profile=self.profile, **self.options)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_http": None}  # connections do not travel


def _registered(env: str) -> bool:
    try:
        env_class(env)
    except KeyError:
        return False
    return True


def remote_factory(spec: str, env: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                   **options: Any) -> RemoteFactory:
    """The engine's ``env_factory`` for the server at ``spec`` (``[DIALECT+]URL``); see
    :class:`RemoteFactory`."""
    return RemoteFactory(spec, env, timeout=timeout, **options)
