"""ScienceWorld's side of the ``sciworld`` env: starting a JVM, and what ScienceWorld says about
its tasks (each family's variations per split, task descriptions, gold paths), cached on disk.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import weakref
from typing import Any

from omrl_search.cache import cache_root
from omrl_search.env import EnvError
from omrl_search.types import Task

from ._optional import require

#: the built-in splits' families: short gold paths (4-24 steps), five kinds of science task
FAMILIES = ("find-plant", "lifespan-longest-lived", "power-component", "use-thermometer",
            "identify-life-stages-2")
PER_FAMILY = {"train": 10, "dev": 4, "test": 4}  # variations per family in the built-in splits
SPLITS = tuple(PER_FAMILY)
JAVA_OPTS = "-Xmx512m -XX:+UseSerialGC"
SIMPLIFICATIONS = {"easy", "teleportAction", "selfWateringFlowerPots", "openContainers",
                   "openDoors", "noElectricalAction"}

_JVM_LOCK = threading.Lock()


def start_jvm() -> Any:
    """A ``ScienceWorldEnv`` in a new JVM, its heap capped by :data:`JAVA_OPTS` (or
    ``$OMRL_SCIWORLD_JAVA_OPTS``; a ``JAVA_TOOL_OPTIONS`` of your own wins): uncapped, one JVM
    grew to 1.7 GB here, and a search holds one per tree plus one in a scripted policy. The
    JVM's process id is noted (the Java child this start added) for :func:`stop_jvm`."""
    cls = require("scienceworld", "sciworld").ScienceWorldEnv
    with _JVM_LOCK:  # JAVA_TOOL_OPTIONS reaches only the JVM started here
        own = "JAVA_TOOL_OPTIONS" in os.environ
        if not own:
            os.environ["JAVA_TOOL_OPTIONS"] = os.environ.get("OMRL_SCIWORLD_JAVA_OPTS", JAVA_OPTS)
        before = java_children()
        try:
            sw = cls("")
        except OSError as exc:
            raise EnvError(f"cannot start ScienceWorld's JVM ({exc}): it needs Java 11+ on PATH") from None
        finally:
            if not own:
                os.environ.pop("JAVA_TOOL_OPTIONS", None)
        new = java_children() - before
        if len(new) == 1:
            _JVM_PIDS[sw] = new.pop()
        return sw


#: the JVM process of each env :func:`start_jvm` made (ScienceWorld keeps no public handle on it)
_JVM_PIDS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def java_children() -> set[int]:
    """The ids of this process's child processes that run Java (read from /proc; none where
    there is no /proc)."""
    me, out = os.getpid(), set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in filter(str.isdigit, names):
        try:
            with open(f"/proc/{name}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
        except OSError:  # gone meanwhile
            continue
        if int(rest.split()[1]) == me and comm.endswith("(java"):
            out.add(int(name))
    return out


def stop_jvm(sw: Any, wait: float = 10.0) -> None:
    """Close ``sw`` (a :func:`start_jvm` env) and reap its JVM. ScienceWorld's own ``close``
    only asks the JVM to exit and never waits for it, so a process that stopped with envs open
    left each JVM to exit after it, an orphan zombie until PID 1 reaps it. A JVM that has not
    exited within ``wait`` seconds is killed."""
    pid = _JVM_PIDS.pop(sw, None)
    sw.close()
    if pid is None:
        return
    deadline = time.monotonic() + wait
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.02)
    except ChildProcessError:  # already reaped (by the Popen that started it)
        pass


def make_task(family: str, variation: int, split: str, description: str,
              simplifications: str = "", task_id: str | None = None) -> Task:
    data: dict[str, Any] = {"task": family, "variation": variation}
    if simplifications:
        data["simplifications"] = simplifications
    tid = task_id or f"{family}-{variation}" + (f"-{simplifications}" if simplifications else "")
    return Task(env="sciworld", task_id=tid, split=split, seed=variation, instruction=description,
                data=data)


_CACHE: dict[str, dict[str, Any]] = {}  # "splits", "descriptions", "gold" (see cache_file)
_CACHE_LOCK = threading.RLock()


def cache_file() -> str:
    """``$OMRL_CACHE/sciworld/scienceworld-<version>.json``: each family's variations per split,
    task descriptions and gold paths. Reading them needs a JVM and loads (seconds); gold path
    generation is random, so keeping the first one also keeps the expert the same from run to run."""
    version = require("scienceworld", "sciworld").__version__
    return os.path.join(cache_root(), "sciworld", f"scienceworld-{version}.json")


def cached(kind: str) -> dict[str, Any]:
    """This process's entries of ``kind`` (read from the cache file on first use)."""
    with _CACHE_LOCK:
        if not _CACHE:
            try:
                with open(cache_file()) as f:
                    _CACHE.update(json.load(f))
            except (OSError, ValueError):
                pass
            for k in ("splits", "descriptions", "gold"):
                _CACHE.setdefault(k, {})
        return _CACHE[kind]


def save_cache() -> None:
    """Merge this process's entries into the file (written whole, then renamed: never torn)."""
    path = cache_file()
    with _CACHE_LOCK:
        try:
            with open(path) as f:
                disk = json.load(f)
        except (OSError, ValueError):
            disk = {}
        for kind, entries in _CACHE.items():
            disk[kind] = {**disk.get(kind, {}), **entries}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(disk, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs time


class Catalog:
    """Variations and descriptions, from the cache or a JVM started on first need."""

    def __init__(self) -> None:
        self.sw: Any = None

    def __enter__(self) -> "Catalog":
        _CACHE_LOCK.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.sw is not None:
            stop_jvm(self.sw)
            save_cache()
        _CACHE_LOCK.release()

    def _load(self, family: str, variation: int) -> Any:
        if self.sw is None:
            self.sw = start_jvm()
        self.sw.load(family, variation, "", False)
        return self.sw

    def splits(self, family: str) -> dict[str, list[int]]:
        store = cached("splits")
        if family not in store:
            sw = self._load(family, 0)
            store[family] = {"train": list(sw.get_variations_train()),
                             "dev": list(sw.get_variations_dev()),
                             "test": list(sw.get_variations_test())}
        return store[family]

    def description(self, family: str, variation: int) -> str:
        store, key = cached("descriptions"), f"{family}:{variation}"
        if key not in store:
            store[key] = self._load(family, variation).get_task_description()
        return store[key]


def family_names() -> list[str]:
    """ScienceWorld's 30 task families (no JVM needed)."""
    return list(require("scienceworld.constants", "sciworld").ID2TASK.values())


def split_tasks(split: str, families: tuple[str, ...] = FAMILIES, per_family: int | None = None,
                limit: int | None = None) -> list[Task]:
    """The first ``per_family`` variations of ``split`` of each family, interleaved (one of each
    family, then the second of each...), so any prefix mixes families."""
    if split not in SPLITS:
        raise ValueError(f"sciworld has ScienceWorld's splits {', '.join(SPLITS)}, not {split!r}")
    per = PER_FAMILY[split] if per_family is None else per_family
    with Catalog() as cat:
        columns = [[(f, v) for v in cat.splits(f)[split][:per]] for f in families]
        order = [fv for rank in range(per) for col in columns if rank < len(col) for fv in [col[rank]]]
        order = order[:limit] if limit is not None else order
        return [make_task(f, v, split, cat.description(f, v)) for f, v in order]


def task_from_row(row: dict[str, Any]) -> Task:
    """A task from a JSONL row ``{"task": family, "variation": n}`` (+ optional
    ``simplifications``, ``task_id``); its split is the ScienceWorld split of the variation."""
    family, variation = row["task"], row["variation"]
    known = family_names()
    if family not in known:
        raise ValueError(f"unknown ScienceWorld task {family!r} (known: {', '.join(known)})")
    if isinstance(variation, bool) or not isinstance(variation, int):
        raise ValueError(f"variation must be an integer, got {variation!r}")
    simplifications = row.get("simplifications", "")
    bad = set(filter(None, str(simplifications).split(","))) - SIMPLIFICATIONS
    if bad:
        raise ValueError(f"unknown simplification(s) {', '.join(sorted(bad))} "
                         f"(known: {', '.join(sorted(SIMPLIFICATIONS))})")
    with Catalog() as cat:
        splits = cat.splits(family)
        split = next((s for s, vs in splits.items() if variation in vs), None)
        if split is None:
            total = sum(map(len, splits.values()))
            raise ValueError(f"{family} has variations 0..{total - 1}, not {variation}")
        return make_task(family, variation, split, cat.description(family, variation),
                         simplifications, row.get("task_id"))
