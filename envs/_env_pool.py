"""The live envs of an env server: ids, a lock per env, a cap with idle expiry, stored snapshots.

Pure Python (no HTTP), so :mod:`envs.server` stays a thin FastAPI layer over it. Errors are
:class:`ApiError` with the HTTP status they should be answered with.
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omrl_search.env import Env, EnvError, env_class, make_env
from omrl_search.types import Snapshot, Task

PROTOCOL = "omrl-env/1"  # what /info answers, so clients can tell this server from AgentGym's
_ENDED_KEPT = 10_000  # closed/expired ids remembered, to answer 410 instead of 404


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Slot:
    """A live env and what the server tracks about its episode."""

    env: Env | None
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: Task | None = None
    score: float = 0.0
    done: bool = False
    snaps: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Stored:
    """A snapshot kept on the server, with the episode facts that go with it."""

    owner: int
    snapshot: Snapshot
    task: Task | None
    score: float
    done: bool


class EnvPool:
    """The live instances of one registered env, by integer id.

    The pool lock guards the tables (ids, snapshots); each env's own lock serialises calls into
    that env. At most ``max_envs`` live at once; one unused for ``idle_timeout`` seconds is closed
    (checked when it is next used, and on every ``create`` and ``health``).
    """

    def __init__(self, env: str, *, max_envs: int = 64, idle_timeout: float = 600.0,
                 max_snapshots: int = 20_000, clock: Callable[[], float] = time.monotonic):
        self.name, self.cls = env, env_class(env)
        self.max_envs, self.idle_timeout, self.max_snapshots = max_envs, idle_timeout, max_snapshots
        self.clock = clock
        self._lock = threading.Lock()
        self._slots: dict[int, Slot] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._snaps: OrderedDict[str, Stored] = OrderedDict()
        self._ids, self._snap_ids = itertools.count(), itertools.count()
        self._tasks: dict[str, list[Task]] = {}

    # --- lifecycle ---------------------------------------------------------------------------
    def create(self) -> int:
        self._expire_idle()
        self._check_cap()
        env = _env_call("start", make_env, self.name)  # unlocked: some envs take seconds to start
        with self._lock:
            if len(self._slots) >= self.max_envs:
                env.close()
                self._check_cap()
            idx = next(self._ids)
            self._slots[idx] = Slot(env, self.clock())
        return idx

    def _check_cap(self) -> None:
        if len(self._slots) >= self.max_envs:
            raise ApiError(503, f"env cap reached: {self.max_envs} live envs; close some (POST /close) "
                                f"or restart the server with a larger --max-envs")

    def close(self, idx: int, why: str = "closed") -> None:
        with self.use(idx) as slot:
            self._end(idx, slot, why)

    def _end(self, idx: int, slot: Slot, why: str) -> None:
        """Forget env ``idx`` and its snapshots, then close it (caller holds its lock or it is idle)."""
        with self._lock:
            self._slots.pop(idx, None)
            self._ended[idx] = why
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
            for sid in slot.snaps:
                self._snaps.pop(sid, None)
        env, slot.env = slot.env, None
        try:
            env.close()
        except Exception:  # a failing close must not take the server down
            pass

    def _expire_idle(self) -> None:
        with self._lock:
            slots = list(self._slots.items())
        for idx, slot in slots:
            if self._idle(slot) and slot.lock.acquire(blocking=False):  # a locked env is in use
                try:
                    if slot.env is not None and self._idle(slot):
                        self._end(idx, slot, f"expired after {self.idle_timeout:g} s idle")
                finally:
                    slot.lock.release()

    def _idle(self, slot: Slot) -> bool:
        return self.clock() - slot.last_used > self.idle_timeout

    def close_all(self) -> None:
        with self._lock:
            slots = list(self._slots.items())
        for idx, slot in slots:
            with slot.lock:
                if slot.env is not None:
                    self._end(idx, slot, "closed: the server shut down")

    @contextmanager
    def use(self, idx: int) -> Iterator[Slot]:
        """Env ``idx`` locked for the caller: 404 if it never existed, 410 if it is gone."""
        with self._lock:
            slot = self._slots.get(idx)
            if slot is None:
                why = self._ended.get(idx)
                if why is None:
                    raise ApiError(404, f"env {idx} not found: create one with POST /create")
                raise ApiError(410, f"env {idx} was {why}")
        with slot.lock:
            if slot.env is None:  # closed while this request waited for the lock
                raise ApiError(410, f"env {idx} was {self._ended.get(idx, 'closed')}")
            if self._idle(slot):
                self._end(idx, slot, f"expired after {self.idle_timeout:g} s idle")
                raise ApiError(410, f"env {idx} was expired after {self.idle_timeout:g} s idle")
            try:
                yield slot
            finally:
                slot.last_used = self.clock()

    # --- episodes ----------------------------------------------------------------------------
    def task_at(self, data_idx: int, split: str) -> Task:
        tasks = self._tasks.get(split)
        if tasks is None:
            try:
                tasks = self._tasks[split] = self.cls.tasks(split)
            except NotImplementedError:
                raise ApiError(422, f"env {self.name!r} has no built-in task set: reset with a full "
                                    f"task dict (\"task\")") from None
            except ValueError as exc:
                raise ApiError(422, str(exc)) from None
        if not 0 <= data_idx < len(tasks):
            raise ApiError(422, f"data_idx {data_idx} out of range: split {split!r} of {self.name} "
                                f"has {len(tasks)} tasks (0..{len(tasks) - 1})")
        return tasks[data_idx]

    def reset(self, idx: int, task: Task, snapshot: bool = False) -> dict[str, Any]:
        with self.use(idx) as slot:
            try:
                obs = slot.env.reset(task)
            except EnvError as exc:
                raise ApiError(409, f"reset failed: {exc}") from None
            except (ValueError, KeyError, TypeError) as exc:
                raise ApiError(422, f"task {task.task_id!r} rejected by env {self.name}: "
                                    f"{type(exc).__name__}: {exc}") from None
            except Exception as exc:
                raise ApiError(500, f"env reset raised {type(exc).__name__}: {exc}") from None
            slot.task, slot.score, slot.done = task, 0.0, False
            out = {"id": idx, "observation": obs, "reward": 0.0, "score": 0.0, "done": False,
                   "task_id": task.task_id, "instruction": task.instruction,
                   "state_key": slot.env.state_key()}
            if snapshot:
                out["snapshot_id"] = self._store(idx, slot)
            return out

    def step(self, idx: int, action: str, snapshot: bool = False) -> dict[str, Any]:
        with self.use(idx) as slot:
            if slot.task is None:
                raise ApiError(409, f"env {idx} has no episode yet: POST /reset first")
            if slot.done:
                raise ApiError(409, f"the episode of env {idx} is over (done): reset it or restore "
                                    "a snapshot")
            res = _env_call("step", slot.env.step, action)
            slot.score += res.reward
            slot.done = bool(res.done)
            out = {"observation": res.observation, "reward": res.reward, "score": slot.score,
                   "done": slot.done, "info": jsonable(res.info), "state_key": slot.env.state_key()}
            if snapshot:
                out["snapshot_id"] = self._store(idx, slot)
            return out

    def observation(self, idx: int) -> str:
        with self.use(idx) as slot:
            self._need_episode(idx, slot)
            return _env_call("observe", slot.env.observe)

    def query(self, idx: int, what: str) -> Any:
        """``valid_actions``, ``expert_action`` or ``heuristic`` of env ``idx``'s state."""
        with self.use(idx) as slot:
            self._need_episode(idx, slot)
            method = getattr(slot.env, what, None)
            if not callable(method):
                raise ApiError(404, f"env {self.name!r} has no {what}()")
            return jsonable(_env_call(what, method))

    @staticmethod
    def _need_episode(idx: int, slot: Slot) -> None:
        if slot.task is None:
            raise ApiError(409, f"env {idx} has no episode yet: POST /reset first")

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot(self, idx: int) -> dict[str, Any]:
        with self.use(idx) as slot:
            self._need_episode(idx, slot)
            return {"snapshot_id": self._store(idx, slot), "state_key": slot.env.state_key(),
                    "observation": slot.env.observe()}

    def _store(self, idx: int, slot: Slot) -> str:
        snap = _env_call("snapshot", slot.env.snapshot)
        with self._lock:
            sid = f"s{next(self._snap_ids)}"
            self._snaps[sid] = Stored(idx, snap, slot.task, slot.score, slot.done)
            slot.snaps.add(sid)
            while len(self._snaps) > self.max_snapshots:
                old, stored = self._snaps.popitem(last=False)
                owner = self._slots.get(stored.owner)
                if owner is not None:
                    owner.snaps.discard(old)
        return sid

    def _snaps_get(self, sid: str) -> Stored:
        with self._lock:
            stored = self._snaps.get(sid)
            if stored is None:
                raise ApiError(404, f"snapshot {sid!r} not found: evicted (the server keeps the "
                                    f"{self.max_snapshots} most recently used), its env was closed, "
                                    "or it never existed")
            self._snaps.move_to_end(sid)
            return stored

    def restore(self, idx: int, sid: str) -> dict[str, Any]:
        stored = self._snaps_get(sid)
        with self.use(idx) as slot:
            return self._restore_into(slot, stored)

    def _restore_into(self, slot: Slot, stored: Stored) -> dict[str, Any]:
        _env_call("restore", slot.env.restore, stored.snapshot)
        slot.task, slot.score, slot.done = stored.task, stored.score, stored.done
        return {"observation": stored.snapshot.observation, "state_key": slot.env.state_key(),
                "score": slot.score, "done": slot.done}

    def fork(self, idx: int, sid: str | None = None) -> dict[str, Any]:
        """A new env in env ``idx``'s current state (or in stored snapshot ``sid``)."""
        if sid is not None:
            stored = self._snaps_get(sid)
            with self.use(idx):
                pass  # the source must still be live
        else:
            with self.use(idx) as slot:
                self._need_episode(idx, slot)
                snap = _env_call("snapshot", slot.env.snapshot)
                stored = Stored(idx, snap, slot.task, slot.score, slot.done)
        new = self.create()
        with self.use(new) as slot:
            try:
                return {"id": new, **self._restore_into(slot, stored)}
            except ApiError:
                self._end(new, slot, "closed: the fork failed")
                raise

    # --- about -------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        c = self.cls
        return {"protocol": PROTOCOL, "env": self.name, "description": c.description,
                "action_help": c.action_help, "examples": c.examples, "max_steps": c.max_steps,
                "snapshot_kind": c.snapshot_kind, "can_restore": c.can_restore,
                "heuristic": callable(getattr(c, "heuristic", None))}

    def health(self) -> dict[str, Any]:
        self._expire_idle()
        with self._lock:
            return {"status": "ok", "env": self.name, "live_envs": len(self._slots),
                    "max_envs": self.max_envs, "snapshots": len(self._snaps),
                    "max_snapshots": self.max_snapshots, "idle_timeout": self.idle_timeout}


def _env_call(what: str, fn: Callable, *args: Any) -> Any:
    """Call into the env: misuse it reports (EnvError) is a 409, any other exception a 500."""
    try:
        return fn(*args)
    except EnvError as exc:
        raise ApiError(409, f"{what} refused: {exc}") from None
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(500, f"env {what} raised {type(exc).__name__}: {exc}") from None


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data: tuples as lists, sets as sorted lists, Fractions and any
    other value as their ``str``."""
    return json.loads(json.dumps(obj, default=_json_value))


def _json_value(obj: Any) -> Any:
    return sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else str(obj)
