"""The live envs of an env server: ids, a lock per env, a cap with idle expiry, stored snapshots,
task validation and a time limit on every call into an env.

Pure Python (no HTTP), so :mod:`envs.server` stays a thin FastAPI layer over it. Errors are
:class:`ApiError` with the HTTP status they should be answered with.

Env work runs on the pool's worker threads and each request waits for it at most
``call_timeout`` seconds. Past that the request is answered 504 and the env is discarded (its id
answers 410); Python cannot stop a thread, so the call runs on to its end, the env is closed
then, and until then it still counts against ``max_envs``.
"""
from __future__ import annotations

import itertools
import json
import queue
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omrl_search.env import Env, EnvError, env_class, make_env
from omrl_search.types import Snapshot, Task

from ._agentgym import scorer, worded

PROTOCOL = "omrl-env/1"  # what /info answers, so clients can tell this server from AgentGym's
_ENDED_KEPT = 10_000  # closed/expired ids remembered, to answer 410 instead of 404
_SHOWN = 300  # characters of an env's error message shown (a rejected task may quote megabytes)


def keys(env: Any) -> dict[str, str]:
    """The state key the server reports, and the dedup key when the env has one of its own
    (``Env.dedup_key``: e.g. Game24's position without its path), so a client's searches merge
    the same states as in process."""
    out = {"state_key": env.state_key()}
    if getattr(env, "own_dedup_key", False):
        out["dedup_key"] = env.dedup_key()
    return out


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Slot:
    """A live env and what the server tracks about its episode.

    ``family``: the id of the env this one was created as or forked from (its own id unless
    forked); snapshots are shared within a family and invisible outside it.
    """

    env: Env | None
    last_used: float
    family: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: Task | None = None
    score: float = 0.0
    done: bool = False
    snaps: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Stored:
    """A snapshot kept on the server, with the episode facts that go with it."""

    owner: int
    family: int
    snapshot: Snapshot
    task: Task | None
    score: float
    done: bool


class EnvPool:
    """The live instances of one registered env, by integer id.

    The pool lock guards the tables (ids, snapshots); each env's own lock serialises calls into
    that env. At most ``max_envs`` live at once (envs discarded with a call still running
    count); one unused for ``idle_timeout`` seconds is closed (checked when it is next used, and
    on every ``create`` and ``health``). Each request's env work gets ``call_timeout`` seconds.
    ``trust_tasks``: accept full task dicts for an env that has no ``task_from_dict`` to check
    them (otherwise such an env resets by ``data_idx`` only).
    """

    def __init__(self, env: str, *, max_envs: int = 64, idle_timeout: float = 600.0,
                 max_snapshots: int = 20_000, call_timeout: float = 60.0, trust_tasks: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.cls = env, env_class(env)
        self.max_envs, self.idle_timeout, self.max_snapshots = max_envs, idle_timeout, max_snapshots
        self.call_timeout, self.trust_tasks, self.clock = call_timeout, trust_tasks, clock
        self._lock = threading.Lock()
        self._slots: dict[int, Slot] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._snaps: OrderedDict[str, Stored] = OrderedDict()
        self._ids = itertools.count()
        self._tasks: dict[str, list[Task]] = {}
        self._running_late = 0  # calls past their time limit, still running
        self._work = Workers(f"omrl-env-{env}")
        self._score = scorer(env)  # the episode score on the scale of the env's AgentGym server

    # --- env work under a time limit -----------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + self.call_timeout

    def _timed(self, what: str, deadline: float, fn: Callable[[], Any], *, idx: int | None = None,
               slot: Slot | None = None, task: Task | None = None) -> Any:
        """``fn()`` on a worker thread, waited for until ``deadline``: env errors become
        ApiErrors (:func:`_env_call`); past the deadline a 504, and env ``idx`` is discarded."""
        try:
            future = self._work.submit(_env_call, what, fn, task)
        except RuntimeError:  # the pool was shut down
            raise ApiError(503, "the server is shutting down") from None
        try:
            return future.result(max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            pass
        env = self._discard(idx, slot, f"discarded: its {what} ran past the {self.call_timeout:g} s "
                                       "time limit") if slot is not None else None
        with self._lock:
            self._running_late += 1
        future.add_done_callback(lambda f: self._late_call_ended(f, what, env))
        tail = f"; env {idx} was discarded" if slot is not None else ""
        raise ApiError(504, f"env {what} ran past the server's time limit of {self.call_timeout:g} s "
                            f"per request (--call-timeout){tail}")

    def _late_call_ended(self, future, what: str, env: Env | None) -> None:
        if what == "start" and not future.cancelled() and future.exception() is None:
            env = future.result()  # made too late: nobody holds it
        if env is not None:
            _quiet_close(env)
        with self._lock:
            self._running_late -= 1

    # --- lifecycle ---------------------------------------------------------------------------
    def create(self, family: int | None = None, deadline: float | None = None) -> int:
        deadline = deadline or self._deadline()
        self._expire_idle()
        with self._lock:
            self._check_cap()
        env = self._timed("start", deadline, lambda: make_env(self.name))  # unlocked: can take s
        with self._lock:
            if len(self._slots) + self._running_late >= self.max_envs:
                self._close_later(env)
                self._check_cap()
            idx = next(self._ids)
            self._slots[idx] = Slot(env, self.clock(), idx if family is None else family)
        return idx

    def start(self, first_episode: bool = True) -> dict[str, Any]:
        """A new env, as ``/create`` answers it: its id and, as AgentGym's TextCraft server
        does, the first observation of task ``data_idx = id`` (modulo the test split's size)
        when ``first_episode`` and the env has a task list (else an empty observation). If that
        reset fails, the env is closed again and the error answered: nothing is left open."""
        deadline = self._deadline()
        idx = self.create(deadline=deadline)
        out = {"id": idx, "observation": "", "reward": 0.0, "done": False}
        if not first_episode or not self._has_tasks("test"):
            return out
        try:
            first = self.reset(idx, data_idx=idx, split="test")
        except ApiError:
            self._close_quietly(idx)
            raise
        return {**out, "observation": first["observation"], "task_id": first["task_id"]}

    def _close_quietly(self, idx: int) -> None:
        try:
            self.close(idx)
        except ApiError:  # already discarded (a timeout) or closed
            pass

    def _check_cap(self) -> None:
        """503 when the cap is reached (caller holds the pool lock)."""
        if len(self._slots) + self._running_late >= self.max_envs:
            late = (f", {self._running_late} of them discarded with a call past the time limit "
                    "still running") if self._running_late else ""
            raise ApiError(503, f"env cap reached: {self.max_envs} live envs{late}; close some "
                                "(POST /close) or restart the server with a larger --max-envs")

    def close(self, idx: int) -> None:
        with self.use(idx, self._deadline()) as slot:
            self._close_later(self._discard(idx, slot, "closed"))

    def _discard(self, idx: int, slot: Slot, why: str) -> Env | None:
        """Forget env ``idx`` and its snapshots; the env, for the caller to close (caller holds
        its lock, or it is idle)."""
        with self._lock:
            self._slots.pop(idx, None)
            self._ended[idx] = why
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
            for sid in slot.snaps:
                self._snaps.pop(sid, None)
        env, slot.env = slot.env, None
        return env

    def _close_later(self, env: Env | None) -> None:
        """Close ``env`` on a worker thread (a slow close must not hold up the request)."""
        if env is not None:
            try:
                self._work.submit(_quiet_close, env)
            except RuntimeError:  # shutting down
                _quiet_close(env)

    def _expire_idle(self) -> None:
        with self._lock:
            slots = list(self._slots.items())
        for idx, slot in slots:
            if self._idle(slot) and slot.lock.acquire(blocking=False):  # a locked env is in use
                try:
                    if slot.env is not None and self._idle(slot):
                        self._close_later(self._discard(idx, slot, self._expired()))
                finally:
                    slot.lock.release()

    def _idle(self, slot: Slot) -> bool:
        return self.clock() - slot.last_used > self.idle_timeout

    def _expired(self) -> str:
        return f"expired after {self.idle_timeout:g} s idle"

    def close_all(self) -> None:
        """Close every env (at shutdown); calls still running past their limit are not waited for."""
        with self._lock:
            slots = list(self._slots.items())
        for idx, slot in slots:
            if slot.lock.acquire(timeout=1.0):  # a busy env is left to its (daemon) thread
                try:
                    if slot.env is not None:
                        _quiet_close(self._discard(idx, slot, "closed: the server shut down"))
                finally:
                    slot.lock.release()
        self._work.shutdown()

    @contextmanager
    def use(self, idx: int, deadline: float | None = None) -> Iterator[Slot]:
        """Env ``idx`` locked for the caller: 404 if it never existed, 410 if it is gone, 503 if
        another request keeps it busy past ``deadline`` (default: one call timeout from now)."""
        deadline = deadline or self._deadline()
        with self._lock:
            slot = self._slots.get(idx)
            if slot is None:
                why = self._ended.get(idx)
                if why is None:
                    raise ApiError(404, f"env {idx} not found: create one with POST /create")
                raise ApiError(410, f"env {idx} was {why}")
        if not slot.lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise ApiError(503, f"env {idx} is busy with another request; try again")
        try:
            if slot.env is None:  # closed while this request waited for the lock
                raise ApiError(410, f"env {idx} was {self._ended.get(idx, 'closed')}")
            if self._idle(slot):
                self._close_later(self._discard(idx, slot, self._expired()))
                raise ApiError(410, f"env {idx} was {self._expired()}")
            try:
                yield slot
            finally:
                slot.last_used = self.clock()
        finally:
            slot.lock.release()

    # --- episodes ----------------------------------------------------------------------------
    def task_list(self, split: str) -> list[Task]:
        """The env's own tasks of ``split``, loaded once (422 when it has none)."""
        tasks = self._tasks.get(split)
        if tasks is None:
            try:
                tasks = self._tasks[split] = self.cls.tasks(split)
            except NotImplementedError:
                raise ApiError(422, f"env {self.name!r} has no built-in task set: reset with a full "
                                    f"task dict (\"task\")") from None
            except ValueError as exc:
                raise ApiError(422, _cut(str(exc))) from None
            if not tasks:
                raise ApiError(422, f"split {split!r} of {self.name} has no tasks")
        return tasks

    def _has_tasks(self, split: str) -> bool:
        try:
            return bool(self.task_list(split))
        except ApiError:
            return False

    def task_at(self, data_idx: int, split: str) -> Task:
        """Task ``data_idx`` of ``split``, any index >= 0 taken modulo the split's size (as
        AgentGym's BabyAI server takes any index): clients iterate indices of their own."""
        if data_idx < 0:
            raise ApiError(422, f"data_idx must be >= 0, got {data_idx}")
        tasks = self.task_list(split)
        return tasks[data_idx % len(tasks)]

    def validate_task(self, body: dict[str, Any], deadline: float) -> Task:
        """A client's task dict (the fields of :class:`~omrl_search.types.Task`) checked by the
        env's own ``task_from_dict``: its ``data`` with ``task_id``, ``split`` and
        ``instruction`` is the row the env validates, and the task it returns is the one used."""
        if body.get("env") not in (None, self.name):
            raise ApiError(422, f"task.env: the task is for env {body['env']!r}, this server "
                                f"serves {self.name!r}")
        row = {**body.get("data", {}), "task_id": body["task_id"], "split": body["split"]}
        if body.get("instruction"):
            row["instruction"] = body["instruction"]
        check = getattr(self.cls, "task_from_dict", None)

        def parse() -> Task:
            try:
                task = check(row)
            except NotImplementedError:
                if not self.trust_tasks:
                    raise ApiError(422, f"task: env {self.name!r} cannot check task dicts (no "
                                        "task_from_dict): reset by data_idx, or start the server "
                                        "with --trust-tasks") from None
                task = Task(env=self.name, task_id=body["task_id"], split=body["split"],
                            seed=body["seed"], instruction=body["instruction"], data=body["data"])
            except (ValueError, TypeError, KeyError) as exc:
                reason = exc.args[0] if exc.args and isinstance(exc.args[0], str) else repr(exc)
                raise ApiError(422, f"task rejected by env {self.name}: {_cut(reason)}") from None
            if not isinstance(task, Task) or task.env != self.name:
                raise ApiError(500, f"env {self.name}'s task_from_dict returned {type(task).__name__}"
                                    f" for env {getattr(task, 'env', None)!r}")
            return task

        return self._timed("task check", deadline, parse)

    def reset(self, idx: int, *, task: dict[str, Any] | None = None, data_idx: int | None = None,
              split: str = "test", snapshot: bool = False) -> dict[str, Any]:
        """Start a task on env ``idx``: a client's task dict (validated) or ``data_idx``. A reset
        by index answers as the env's AgentGym server does (:func:`envs._agentgym.worded`: the
        goal in the observation, SciWorld's ``task_description``...); one with a task dict
        answers the env's own observation, the instruction apart."""
        if task is None:
            chosen = self.task_at(data_idx, split)  # the env's own list, loaded once: not timed
            deadline = self._deadline()
        else:
            deadline = self._deadline()
            chosen = self.validate_task(task, deadline)
        with self.use(idx, deadline) as slot:
            env = slot.env

            def work():
                obs = env.reset(chosen)
                return obs, keys(env), env.snapshot() if snapshot else None

            obs, key, snap = self._timed("reset", deadline, work, idx=idx, slot=slot, task=chosen)
            slot.task, slot.score, slot.done = chosen, 0.0, False
            shown, extra = worded(self.name, chosen, obs, by_index=task is None)
            out = {"id": idx, "observation": shown, "reward": 0.0, "score": 0.0, "done": False,
                   "task_id": chosen.task_id, "instruction": chosen.instruction, **key,
                   **extra}
            if snap is not None:
                out["snapshot_id"] = self._store(idx, slot, snap)
            return out

    def step(self, idx: int, action: str, snapshot: bool = False) -> dict[str, Any]:
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            if slot.task is None:
                raise ApiError(409, f"env {idx} has no episode yet: POST /reset first")
            if slot.done:
                raise ApiError(409, f"the episode of env {idx} is over (done): reset it or restore "
                                    "a snapshot")
            env = slot.env

            def work():
                res = env.step(action)
                return res, jsonable(res.info), keys(env), env.snapshot() if snapshot else None

            res, info, key, snap = self._timed("step", deadline, work, idx=idx, slot=slot)
            slot.score = self._score(res, slot.score)
            slot.done = res.done
            out = {"observation": res.observation, "reward": res.reward, "score": slot.score,
                   "done": res.done, "terminated": res.terminated, "truncated": res.truncated,
                   "success": res.success, "valid": res.valid, "info": info, **key}
            if snap is not None:
                out["snapshot_id"] = self._store(idx, slot, snap)
            return out

    def look(self, idx: int) -> dict[str, Any]:
        """A ``/step`` answer for an action that only looks (AgentGym BabyAI's ``check
        available actions``): the current observation, no env step, nothing counted."""
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            if slot.task is None or slot.done:
                raise ApiError(409, f"env {idx} has no episode under way: POST /reset first")
            env = slot.env
            obs, key = self._timed("observe", deadline, lambda: (env.observe(), keys(env)), idx=idx, slot=slot)
            return {"observation": obs, "reward": 0.0, "score": slot.score, "done": False,
                    "terminated": False, "truncated": False, "success": False, "valid": True,
                    "info": {}, **key}

    def observation(self, idx: int) -> str:
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            self._need_episode(idx, slot)
            return self._timed("observe", deadline, slot.env.observe, idx=idx, slot=slot)

    def instruction(self, idx: int) -> str:
        """The instruction of env ``idx``'s task (WebShop's ``/instruction_text``)."""
        with self.use(idx) as slot:
            self._need_episode(idx, slot)
            return slot.task.instruction

    def query(self, idx: int, what: str) -> Any:
        """``valid_actions``, ``expert_action`` or ``heuristic`` of env ``idx``'s state."""
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            self._need_episode(idx, slot)
            method = getattr(slot.env, what, None)
            if not callable(method):
                raise ApiError(404, f"env {self.name!r} has no {what}()")
            return self._timed(what, deadline, lambda: jsonable(method()), idx=idx, slot=slot)

    @staticmethod
    def _need_episode(idx: int, slot: Slot) -> None:
        if slot.task is None:
            raise ApiError(409, f"env {idx} has no episode yet: POST /reset first")

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot(self, idx: int) -> dict[str, Any]:
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            self._need_episode(idx, slot)
            env = slot.env
            snap, key, obs = self._timed("snapshot", deadline,
                                         lambda: (env.snapshot(), keys(env), env.observe()),
                                         idx=idx, slot=slot)
            return {"snapshot_id": self._store(idx, slot, snap), **key, "observation": obs}

    def _store(self, idx: int, slot: Slot, snap: Snapshot) -> str:
        """Keep ``snap`` under a new unguessable id, usable by env ``idx``'s family only."""
        with self._lock:
            sid = secrets.token_urlsafe(16)
            self._snaps[sid] = Stored(idx, slot.family, snap, slot.task, slot.score, slot.done)
            slot.snaps.add(sid)
            while len(self._snaps) > self.max_snapshots:
                old, stored = self._snaps.popitem(last=False)
                owner = self._slots.get(stored.owner)
                if owner is not None:
                    owner.snaps.discard(old)
        return sid

    def _snaps_get(self, sid: str, family: int) -> Stored:
        """Snapshot ``sid`` if env family ``family`` may use it; 404 alike for any other reason."""
        with self._lock:
            stored = self._snaps.get(sid)
            if stored is None or stored.family != family:
                raise ApiError(404, f"snapshot {_cut(sid, 40)!r} not found: evicted (the server "
                                    f"keeps the {self.max_snapshots} most recently used), its env "
                                    "was closed, it was made by an env not forked from this one, "
                                    "or it never existed")
            self._snaps.move_to_end(sid)
            return stored

    def restore(self, idx: int, sid: str) -> dict[str, Any]:
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            return self._restore_into(idx, slot, self._snaps_get(sid, slot.family), deadline)

    def _restore_into(self, idx: int, slot: Slot, stored: Stored, deadline: float) -> dict[str, Any]:
        env = slot.env

        def work():
            env.restore(stored.snapshot)
            return keys(env)

        key = self._timed("restore", deadline, work, idx=idx, slot=slot)
        slot.task, slot.score, slot.done = stored.task, stored.score, stored.done
        return {"observation": stored.snapshot.observation, **key,
                "score": slot.score, "done": slot.done}

    def fork(self, idx: int, sid: str | None = None) -> dict[str, Any]:
        """A new env in env ``idx``'s current state (or in stored snapshot ``sid`` of its family),
        in the same family."""
        deadline = self._deadline()
        with self.use(idx, deadline) as slot:
            family = slot.family
            if sid is not None:
                stored = self._snaps_get(sid, family)
            else:
                self._need_episode(idx, slot)
                snap = self._timed("snapshot", deadline, slot.env.snapshot, idx=idx, slot=slot)
                stored = Stored(idx, family, snap, slot.task, slot.score, slot.done)
        new = self.create(family, deadline)
        with self.use(new, deadline) as slot:
            try:
                return {"id": new, **self._restore_into(new, slot, stored, deadline)}
            except ApiError:
                if slot.env is not None:
                    self._close_later(self._discard(new, slot, "closed: the fork failed"))
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
                    "max_snapshots": self.max_snapshots, "idle_timeout": self.idle_timeout,
                    "call_timeout": self.call_timeout, "calls_past_limit": self._running_late}


class Workers:
    """Daemon threads running submitted calls, one more whenever none is idle. Unlike
    ThreadPoolExecutor's, a call stuck past its time limit does not keep the process from
    exiting."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the workers were shut down")
            spawn = self._idle == 0
            self._idle -= 0 if spawn else 1
        self._jobs.put((future, fn, args))
        if spawn:
            threading.Thread(target=self._run, name=self.name, daemon=True).start()
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                    future.set_exception(exc)
            del job, future, fn, args  # hold nothing while waiting for the next job
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Idle threads end; busy ones end after their call."""
        with self._lock:
            self._closed, idle = True, self._idle
        for _ in range(idle + 1):
            self._jobs.put(None)


def _env_call(what: str, fn: Callable[[], Any], task: Task | None = None) -> Any:
    """Call into the env: misuse it reports (EnvError) is a 409, any other exception a 500; on
    reset (``task`` given) a ValueError/KeyError/TypeError is the task's fault, a 422."""
    try:
        return fn()
    except ApiError:
        raise
    except EnvError as exc:
        raise ApiError(409, f"{what} refused: {_cut(str(exc))}") from None
    except (ValueError, KeyError, TypeError) as exc:
        if task is None:
            raise ApiError(500, f"env {what} raised {type(exc).__name__}: {_cut(str(exc))}") from None
        raise ApiError(422, f"task {_cut(task.task_id, 80)!r} rejected by env {task.env}: "
                            f"{type(exc).__name__}: {_cut(str(exc))}") from None
    except Exception as exc:
        raise ApiError(500, f"env {what} raised {type(exc).__name__}: {_cut(str(exc))}") from None


def _quiet_close(env: Env) -> None:
    try:
        env.close()
    except Exception:  # a failing close must not take the server down
        pass


def _cut(text: str, limit: int = _SHOWN) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data: tuples as lists, sets as sorted lists, Fractions and any
    other value as their ``str``."""
    return json.loads(json.dumps(obj, default=_json_value))


def _json_value(obj: Any) -> Any:
    return sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else str(obj)
