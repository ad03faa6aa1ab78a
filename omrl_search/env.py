"""The environment contract (docs/design.md §4): Gymnasium-like, text in and out, plus snapshots.

An env subclasses :class:`Env` and one snapshot piece:

* :class:`ValueSnapshots` — the state is plain data kept in ``self.state``; a snapshot is that
  data (states should be immutable values, e.g. tuples, so no copy is needed);
* :class:`NativeSnapshots` — the env's own save/load (SQLite ``backup()``, a git tree, ...);
* :class:`ReplayEnv` — a wrapper that snapshots any deterministic env as *reset + action prefix*,
  and checks the state key after replay to detect divergence.

List the snapshot piece before ``Env`` in the bases (``class MyEnv(ValueSnapshots, Env)``) so
its methods fill in ``Env``'s abstract ones. Installed envs are found through the
``omrl_search.envs`` entry points (docs/design.md §7), envs defined in code with
:func:`register_env`; :func:`make_env` builds either.
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from .plugins import Registry, is_subclass, name_if_unnamed
from .types import Snapshot, StepResult, Task


class EnvError(Exception):
    """Raised for misuse of an env (step before reset, restoring a foreign snapshot...)."""


class ReplayDivergence(EnvError):
    """A replayed action prefix did not reach the recorded state (the env is not deterministic)."""


class TaskFileError(ValueError):
    """A user task file has a bad line; the message is ``file:line: reason``."""


def stable_hash(obj: Any) -> str:
    """A short, process-independent hash of plain data (for state keys and split assignment)."""
    data = obj if isinstance(obj, (bytes, str)) else repr(obj)
    if isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class Env(ABC):
    """A text environment whose state can be snapshotted and restored.

    Class attributes describe the env to prompts and tools: ``name``, ``action_help`` (the
    action syntax as a paragraph starting ``Actions:``, shown to the model and in invalid-action
    messages), ``max_steps`` (default
    horizon of a search) and ``snapshot_kind``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    action_help: ClassVar[str] = ""
    examples: ClassVar[str] = ""
    max_steps: ClassVar[int] = 20
    snapshot_kind: ClassVar[str] = "value"
    can_restore: ClassVar[bool] = True
    #: whether the class overrides dedup_key (set for each subclass; read by wrappers and the
    #: env server to record or report the key only where it differs from the state key)
    own_dedup_key: ClassVar[bool] = False

    # --- episode -------------------------------------------------------------------------
    @abstractmethod
    def reset(self, task: Task) -> str:
        """Start ``task``; return the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action; return a :class:`~omrl_search.types.StepResult` built with keywords:
        ``terminated`` when the task reached an end state (solved, answered, lost), ``truncated``
        when the env cut the episode (its step limit), ``success`` whether the task was solved
        and ``valid=False`` for a malformed or inadmissible action, whose observation says what
        was wrong and what the syntax is (it never raises). ``info`` carries the rest: at the
        end ``info["answer"]``, the final answer as a short string (what majority voting
        compares), and env detail such as ``score``; not ``success`` or ``valid`` (older envs
        that put them there are still read)."""

    @abstractmethod
    def observe(self) -> str:
        """The current observation (what ``reset``/``step`` last showed)."""

    @abstractmethod
    def state_key(self) -> str:
        """A hash of the full state, for detecting replay divergence and, by default, for dedup."""

    def dedup_key(self) -> str:
        """The key under which searches that dedup merge states (transpositions); default the
        state key. An env whose state keeps its history (Game24's path of combines) returns the
        key of the position alone here, so ``dedup`` merges two routes to it while the state
        keys keep them apart (docs/design.md §4)."""
        return self.state_key()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # whether snapshots record a dedup key of their own: only for envs that override it,
        # so the others pay no second hash per step
        cls.own_dedup_key = cls.dedup_key is not Env.dedup_key

    @abstractmethod
    def snapshot(self) -> Snapshot: ...

    @abstractmethod
    def restore(self, snapshot: Snapshot) -> None: ...

    def valid_actions(self) -> list[str] | None:
        """The admissible actions in the current state, when the env can list them."""
        return None

    def expert_action(self) -> str | None:
        """The expert solver's next action from the current state (None if unsolvable)."""
        return None

    def action_grammar(self) -> str | None:
        """Grammar rules defining the rule ``action``: the action language of the current state
        (Game24's ``a op b`` over the numbers left, SQL's ``verb: ARG`` lines), in the common
        subset of GBNF and xgrammar's EBNF (:mod:`omrl_search.constrain`). Structured decoding
        prefers it to :meth:`valid_actions`, which may list only samples (docs/design.md §4).
        None: no syntax known (the format's one-line action, or the listed actions)."""
        return None

    def explain(self, action: str, rng: Any = None) -> str | None:
        """One line of reasoning that ``action`` follows from in the current state (what the
        expert's demonstrations write as their ``Think:`` line), its wording chosen by ``rng``;
        None when the env has nothing to say (or refuses the action)."""
        return None

    def exact_value(self) -> float | None:
        """Optional capability: 1.0 when the task can still be solved from the current state,
        0.0 when it cannot, decided exactly (a solver, no sampling); a finished episode is its
        success. Only envs that can decide it override this (Game24 and Countdown do, see
        :func:`offers_exact_value`); exact labels and the held-out yardstick read it
        (docs/reward_models.md). None: the env cannot tell."""
        return None

    def value_key(self) -> str | None:
        """Optional capability: a key of what the current state's value depends on, the same in
        every task of this env: two unfinished states with equal keys, in any two tasks, can both
        still be solved or neither can (Game24, Countdown: the numbers left and the target).
        ``omrl label --soft q --share-proofs`` reads it to pass a solver-proven win on to every
        step whose state has the same key (docs/reward_models.md). None: the env cannot tell."""
        return None

    def close(self) -> None:
        """Release resources (processes, files)."""

    # --- task sets -----------------------------------------------------------------------
    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        """The env's generated or shipped tasks for ``split`` (train and test never overlap)."""
        raise NotImplementedError(f"env {cls.name!r} has no built-in task set")

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """Validate one user task (a JSONL row); raise ``ValueError(reason)`` when it is bad."""
        raise NotImplementedError(f"env {cls.name!r} does not load task files")

    @classmethod
    def load_tasks(cls, path: str | Path) -> list[Task]:
        """Load user tasks from JSONL; a bad line raises :class:`TaskFileError` as ``file:line: reason``."""
        return load_task_file(path, cls.task_from_dict)


def offers_exact_value(env: "Env | type[Env]") -> bool:
    """Whether ``env`` (an env, a :class:`ReplayEnv` around one, or an env class) offers
    :meth:`Env.exact_value`: its class overrides it."""
    env = getattr(env, "inner", env)
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, "exact_value", Env.exact_value) is not Env.exact_value


def winning_actions(env: Env) -> list[str]:
    """The valid actions after which ``env``'s task can still be won — the state each leads to
    has :meth:`Env.exact_value` 1.0 (a finishing action: its success) — in the order
    :meth:`Env.valid_actions` lists them, each once. Each action is tried on ``env`` itself and
    undone by a restore, so ``env`` ends in the state it started in. Needs an env that lists its
    actions and offers the exact value (:func:`offers_exact_value`)."""
    if not offers_exact_value(env):
        raise TypeError(f"env {env.name!r} does not offer exact_value()")
    snap, out = env.snapshot(), []
    for action in dict.fromkeys(a for a in env.valid_actions() or [] if a is not None):
        try:
            env.step(action)
            won = env.exact_value() == 1.0
        finally:
            env.restore(snap)
        if won:
            out.append(action)
    return out


def load_task_file(path: str | Path, parse: Callable[[dict[str, Any]], Task]) -> list[Task]:
    """Read a JSONL task file, validating every line before returning any task."""
    from .textfile import read_utf8

    path = Path(path)
    try:
        text = read_utf8(path)
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a byte that is not UTF-8: file:line
        raise TaskFileError(str(exc)) from None
    tasks = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        try:
            tasks.append(parse(row))
        except (ValueError, TypeError, KeyError) as exc:
            reason = exc.args[0] if exc.args else type(exc).__name__
            if isinstance(exc, KeyError):
                reason = f"missing field {reason!r}"
            raise TaskFileError(f"{path}:{lineno}: {reason}") from None
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in file")
    return tasks


class ValueSnapshots:
    """Snapshot piece for envs whose whole state is the plain value ``self.state``.

    The env must treat ``self.state`` as immutable (replace it, never mutate it) so that a
    snapshot can share it without copying; ``render()`` turns it into the observation.
    """

    snapshot_kind: ClassVar[str] = "value"
    own_dedup_key: ClassVar[bool] = False
    state: Any

    def snapshot(self) -> Snapshot:
        if getattr(self, "state", None) is None:
            raise EnvError("snapshot() before reset()")
        return Snapshot("value", self.state, self.state_key(), self.observe(), self.name,
                        self.dedup_key() if self.own_dedup_key else "")

    def restore(self, snapshot: Snapshot) -> None:
        check_snapshot(self, snapshot, "value")
        self.state = snapshot.payload

    def position(self) -> Any:
        """The part of the state that identifies it for dedup (default: all of it). Envs that
        keep presentation-only data in the state (the last message) leave it out here, so two
        routes to the same position share a state key."""
        return self.state

    def state_key(self) -> str:
        return stable_hash(self.position())


class NativeSnapshots:
    """Snapshot piece for envs with their own save/load (``save_native``/``load_native``)."""

    snapshot_kind: ClassVar[str] = "native"
    own_dedup_key: ClassVar[bool] = False

    def save_native(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def load_native(self, payload: Any) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        return Snapshot("native", self.save_native(), self.state_key(), self.observe(), self.name,
                        self.dedup_key() if self.own_dedup_key else "")

    def restore(self, snapshot: Snapshot) -> None:
        check_snapshot(self, snapshot, "native")
        self.load_native(snapshot.payload)


def check_snapshot(env: Any, snapshot: Snapshot, kind: str) -> None:
    """Refuse snapshots of another kind or from another env, instead of restoring garbage."""
    if snapshot.kind != kind:
        raise EnvError(f"cannot restore a {snapshot.kind!r} snapshot into a {kind}-snapshot env")
    if snapshot.env and env.name and snapshot.env != env.name:
        raise EnvError(f"cannot restore a snapshot of env {snapshot.env!r} into env {env.name!r}")


class ReplayEnv(Env):
    """Snapshots any deterministic env by replay: reset to the task, re-apply the action prefix.

    The universal fallback (remote envs, envs without a save). After a replay the state key is
    compared with the one recorded at snapshot time; a mismatch raises :class:`ReplayDivergence`
    so a search treats the branch as failed instead of trusting a different state.
    """

    snapshot_kind: ClassVar[str] = "replay"

    def __init__(self, inner: Env):
        self.inner = inner
        self.name = inner.name
        self.action_help = inner.action_help
        self.examples = inner.examples
        self.description = inner.description
        self.max_steps = inner.max_steps
        self._task: Task | None = None
        self._actions: tuple[str, ...] = ()
        self.own_dedup_key = getattr(inner, "own_dedup_key", False)

    def reset(self, task: Task) -> str:
        self._task, self._actions = task, ()
        return self.inner.reset(task)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise EnvError("step() before reset()")
        self._actions = self._actions + (action,)
        return self.inner.step(action)

    def observe(self) -> str:
        return self.inner.observe()

    def state_key(self) -> str:
        return self.inner.state_key()

    def dedup_key(self) -> str:
        return self.inner.dedup_key()

    def snapshot(self) -> Snapshot:
        if self._task is None:
            raise EnvError("snapshot() before reset()")
        return Snapshot("replay", (self._task, self._actions), self.state_key(), self.observe(),
                        self.name, self.inner.dedup_key() if self.own_dedup_key else "")

    def restore(self, snapshot: Snapshot) -> None:
        check_snapshot(self, snapshot, "replay")
        task, actions = snapshot.payload
        self.reset(task)
        for action in actions:
            self.step(action)
        if self.state_key() != snapshot.state_key:
            raise ReplayDivergence(
                f"replaying {len(actions)} actions of task {task.task_id} reached a different state"
            )

    def valid_actions(self) -> list[str] | None:
        return self.inner.valid_actions()

    def expert_action(self) -> str | None:
        return self.inner.expert_action()

    def action_grammar(self) -> str | None:
        return self.inner.action_grammar()

    def explain(self, action: str, rng: Any = None) -> str | None:
        return self.inner.explain(action, rng)

    def exact_value(self) -> float | None:
        return self.inner.exact_value()

    def value_key(self) -> str | None:
        return self.inner.value_key()

    def close(self) -> None:
        self.inner.close()


# --- registry (see docs/design.md §7) ---------------------------------------------------------
_ENVS = Registry("omrl_search.envs", "an Env subclass", is_subclass(Env), name_if_unnamed)
#: ``--env-server`` URLs by scheme (the part before ``+``): factories ``f(url, env) -> env_factory``
_ENV_SERVERS = Registry("omrl_search.env_servers", "an env-server factory f(url, env)", callable)


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    """Class decorator: make an env available to :func:`make_env` and the CLI without an entry
    point (tests, notebooks); installed envs are found through ``omrl_search.envs`` entry points."""

    def deco(cls: type[Env]) -> type[Env]:
        cls.name = name
        return _ENVS.register(name, cls)

    return deco


def list_envs() -> list[str]:
    """Every env name: registered in code or listed as an entry point (none is imported)."""
    return _ENVS.names()


def env_class(name: str) -> type[Env]:
    cls = _ENVS.get(name)
    if cls is None:
        raise KeyError(_ENVS.unknown("env", name))
    return cls


def env_server_factory(url: str, env: str | None = None) -> Callable[[str], Env]:
    """The ``env_factory`` for the env server at ``url`` (``--env-server``), built by the
    ``omrl_search.env_servers`` plugin named by the URL's scheme: ``agentgym+http://h:1`` by
    ``agentgym``, ``http://h:1`` by ``http``. A URL no plugin serves is one ValueError line."""
    scheme, sep, _ = url.partition("://")
    key = scheme.split("+")[0].strip().lower()
    factory = _ENV_SERVERS.get(key) if sep and key else None
    if factory is None:
        known = ", ".join(f"{n}://" for n in _ENV_SERVERS.names()) or "none installed"
        raise ValueError(f"bad env server {url!r}: no env-server plugin for its scheme "
                         f"(known: {known}; e.g. http://127.0.0.1:8000 or agentgym+http://HOST:PORT)")
    return factory(url, env)


def make_env(name: str, *, snapshots: str | None = None, **kwargs: Any) -> Env:
    """Build a registered env. ``snapshots="replay"`` forces replay snapshots on any env."""
    env = env_class(name)(**kwargs)
    if snapshots in (None, env.snapshot_kind):
        return env
    if snapshots == "replay":
        return ReplayEnv(env)
    raise ValueError(f"env {name!r} cannot snapshot by {snapshots!r}")


def iter_valid_kinds(name: str) -> Iterable[str]:
    """Snapshot kinds an env can be run with: its own, and replay."""
    kind = env_class(name).snapshot_kind
    return (kind,) if kind == "replay" else (kind, "replay")
