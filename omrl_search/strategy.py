"""The strategy contract (docs/design.md §4) and its registry (docs/design.md §7).

A strategy is a small dataclass of hyper-parameters with ``async def run(ctx)`` that grows the
tree through the context's batched primitives, and ``select(ctx)`` that names the final node.
One instance serves many tasks at once (``search_many``), so per-search state lives in the
context or the tree, never on ``self``.
"""
from __future__ import annotations

import typing
from collections import Counter
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

from .plugins import Registry, name_if_unnamed
from .specs import SpecError, convert, parse_spec
from .tree import Node

if TYPE_CHECKING:  # pragma: no cover
    from .ops import SearchContext


class Strategy:
    name: ClassVar[str] = ""
    #: True when the final choice consults the env's success check (not a fair test-time method)
    verifier_in_loop: bool = False

    async def run(self, ctx: SearchContext) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def select(self, ctx: SearchContext) -> Node | None:
        """The node whose path is the search's answer (default: the last node added)."""
        return ctx.tree.nodes[-1]

    def spec(self) -> str:
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))  # type: ignore[arg-type]
        return f"{self.name}:{params}" if params else self.name


def majority_vote(nodes: Iterable[Node]) -> Node | None:
    """The first node carrying the most common final answer (ties: earliest answer wins)."""
    nodes = [n for n in nodes if n.step is not None and n.step.info.get("answer") is not None]
    if not nodes:
        return None
    counts = Counter(str(n.step.info["answer"]) for n in nodes)
    top = max(counts.values())
    return next(n for n in nodes if counts[str(n.step.info["answer"])] == top)


def _field_types(cls: type) -> dict[str, Any]:
    """The fields' annotations resolved (a plugin's string annotations included); ``Any`` for
    any that cannot be resolved."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming something not importable here
        return {}


def _is_strategy_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, Strategy) and is_dataclass(obj)


_STRATEGIES = Registry("omrl_search.strategies", "a Strategy dataclass", _is_strategy_class,
                       name_if_unnamed)


def register_strategy(name: str) -> Callable[[type], type]:
    """Class decorator: make a strategy available by ``name`` without an entry point (tests,
    notebooks); installed strategies are found through ``omrl_search.strategies`` entry points."""

    def deco(cls: type) -> type:
        cls.name = name
        return _STRATEGIES.register(name, cls)

    return deco


def list_strategies() -> list[str]:
    return _STRATEGIES.names()


def make_strategy(spec: "str | Strategy") -> Strategy:
    """``"best_of_n:n=8,select_by=vote"`` -> a configured strategy; a Strategy passes through.
    Each value is read as the type its dataclass field is annotated with, so ``beam:width=abc``
    fails here in one line (``strategy 'beam': width must be an int, got 'abc'``)."""
    if isinstance(spec, Strategy):
        return spec
    name, raw = parse_spec(spec, "strategy", raw=True)
    cls = _STRATEGIES.get(name)
    if cls is None:
        raise SpecError(_STRATEGIES.unknown("strategy", name))
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    bad = sorted(set(raw) - known)
    if bad:
        raise SpecError(f"strategy {name!r} has no parameter {', '.join(bad)} "
                        f"(known: {', '.join(sorted(known)) or 'none'})")
    hints = _field_types(cls)
    params = {k: convert(v, hints.get(k, Any), f"strategy {name!r}: {k}") for k, v in raw.items()}
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"bad strategy {spec!r}: {exc}") from None
