"""SearchResult: what one search returns, serialisable to JSON (one line of ``results.jsonl``).

Loading validates through pydantic ``TypeAdapter`` s over the same dataclasses the search uses,
so files written by one version and read by another fail with a clear message, not later.
Snapshot payloads are not serialised (they are live env state); their state keys are.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from .prompts import CONSTRAINT_COUNTS
from .tree import Node, SearchTree, Trajectory
from .types import Step, Task


@dataclass(slots=True)
class SearchResult:
    task: Task
    strategy: str
    tree: SearchTree
    best: int | None  # node id of the chosen leaf
    success: bool
    spent: dict[str, int | float]
    faults: list[str] = field(default_factory=list)
    stop_reason: str = "done"
    seconds: float = 0.0
    verifier_in_loop: bool = False
    #: structured decoding: the setting asked, the mode the search ran under and what each
    #: generation was made under (counts and notes; see :class:`~omrl_search.prompts.Constraint`)
    constraint: dict[str, Any] = field(default_factory=dict)

    @property
    def best_trajectory(self) -> Trajectory | None:
        return None if self.best is None else self.tree.trajectory(self.tree.nodes[self.best])

    @property
    def trajectories(self) -> list[Trajectory]:
        """Every finished (terminal) trajectory in the tree."""
        return [self.tree.trajectory(n) for n in self.tree.terminals()]

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self.tree.nodes:
            d = {f: getattr(n, f) for f in Node.__slots__ if f not in ("snapshot", "step")}
            d["step"] = asdict(n.step) if n.step is not None else None
            nodes.append(d)
        merges = [list(e) for e in self.tree.merges]
        return {"task": asdict(self.task), "strategy": self.strategy, "best": self.best,
                "success": self.success, "spent": self.spent, "faults": self.faults,
                "stop_reason": self.stop_reason, "seconds": self.seconds,
                "verifier_in_loop": self.verifier_in_loop, "constraint": self.constraint,
                "agent": self.tree.agent, "tree": {"nodes": nodes, "merge_edges": merges}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchResult":
        a = _adapters()
        task = a["task"].validate_python(data["task"])
        raw_nodes = data["tree"]["nodes"]
        if not raw_nodes:
            raise ValueError("tree has no nodes")
        nodes = []
        for d in raw_nodes:
            d = dict(d)
            step = a["step"].validate_python(d.pop("step")) if d.get("step") is not None else None
            node = a["node"].validate_python({**d, "step": None, "snapshot": None})
            node.step = step
            nodes.append(node)
        tree = SearchTree(task, nodes[0].observation, None, str(data.get("agent", "react")))
        tree.nodes = nodes
        tree.merges = [(int(u), int(v)) for u, v in data["tree"].get("merge_edges", [])]
        rest = a["meta"].validate_python({k: data[k] for k in _META_FIELDS if k in data})
        return cls(task=task, tree=tree, **rest)

    @classmethod
    def from_json(cls, line: str) -> "SearchResult":
        return cls.from_dict(json.loads(line))


_META_FIELDS = ("strategy", "best", "success", "spent", "faults", "stop_reason", "seconds",
                "verifier_in_loop", "constraint")


@lru_cache(maxsize=1)
def _adapters() -> dict[str, Any]:
    from typing_extensions import TypedDict

    from pydantic import TypeAdapter

    class Meta(TypedDict, total=False):
        strategy: str
        best: int | None
        success: bool
        spent: dict[str, int | float]
        faults: list[str]
        stop_reason: str
        seconds: float
        verifier_in_loop: bool
        constraint: dict[str, Any]

    return {"task": TypeAdapter(Task), "step": TypeAdapter(Step), "node": TypeAdapter(Node),
            "meta": TypeAdapter(Meta)}


def constraint_totals(results: Iterable[SearchResult]) -> dict[str, Any]:
    """Structured decoding over many results (a summary's ``constraint``): the settings asked,
    how many searches ran under each mode, the summed counts and the distinct notes."""
    out: dict[str, Any] = {"asked": [], "modes": {}, **dict.fromkeys(CONSTRAINT_COUNTS, 0), "notes": []}
    for r in results:
        c = r.constraint or {}
        if not c:
            continue
        if c.get("asked") not in out["asked"]:
            out["asked"].append(c.get("asked"))
        mode = str(c.get("mode"))
        out["modes"][mode] = out["modes"].get(mode, 0) + 1
        for key in CONSTRAINT_COUNTS:
            out[key] += int(c.get(key, 0) or 0)
        for note in c.get("notes", ()):
            if note not in out["notes"]:
                out["notes"].append(note)
    out["asked"] = ",".join(str(a) for a in out["asked"])
    return out


def _json_default(obj: Any) -> Any:
    from fractions import Fraction

    if isinstance(obj, Fraction):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file renamed into place, so a reader never sees
    half a file (summaries, tables, markers, reports)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_results(path: str | Path, results: list[SearchResult]) -> None:
    """Write ``results.jsonl`` atomically (a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in results:
            f.write(r.to_json() + "\n")
    tmp.replace(path)


def read_results(path: str | Path) -> Iterator[SearchResult]:
    from .textfile import utf8_lines

    path = Path(path)
    for lineno, line in utf8_lines(path):  # a byte that is not UTF-8: file:line
        if line.strip():
            try:
                yield SearchResult.from_json(line)
            except Exception as exc:
                why = f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else exc
                raise ValueError(f"{path}:{lineno}: {why}".splitlines()[0]) from None
