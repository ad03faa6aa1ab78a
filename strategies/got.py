"""Graph-of-Thoughts (Besta et al., AAAI 2024, "Graph of Thoughts: Solving Elaborate Problems
with Large Language Models"): a declarative graph of operations applied to a set of thoughts.

A thought is a node (a trajectory prefix and its env state). The operations:

* ``generate:k`` — k next steps from every unfinished thought (one batched LM call);
* ``score`` — value every thought (a value source, see :mod:`strategies.values`);
* ``keep_best:n`` — keep the n best-valued thoughts, prune the rest;
* ``aggregate:n`` — merge the n best thoughts into one new thought: a step generated from the
  best one's parent state with all n shown in the prompt, with an edge from each of the n
  (the tree becomes a DAG);
* ``refine`` — improve each unfinished thought: a new step from its parent state with the
  thought shown as the attempt to improve on, with an edge from it.

The graph, e.g. ``generate:3>score>keep_best:3>aggregate:3>score>keep_best:2``, is applied
again and again until no thought can go on; the answer is the best-valued finished thought.
Knobs: ``graph`` (``default`` picks the env's graph from :data:`GRAPHS`), ``value``, ``agg``,
``dedup`` (state | text | none: repeats merged after every operation that adds thoughts),
``temperature``. ``keep_best`` returns the thoughts best first (ties in order), as GoT's
``KeepBestN`` does, and the next operation takes them in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omrl_search.reward import AGGREGATIONS
from omrl_search.strategy import Strategy, register_strategy
from .values import (best_answer, check_dedup, check_value, dedup_nodes, engine_dedup, keep_best,
                     make_value, remember)

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext

GRAPHS = {
    "game24": "generate:3>score>keep_best:3>aggregate:3>score>keep_best:2",
    "countdown": "generate:3>score>keep_best:3>aggregate:3>score>keep_best:2",
    "sokoban": "generate:3>score>keep_best:2>refine>score>keep_best:2",
    "*": "generate:3>score>keep_best:3>aggregate:2>refine>score>keep_best:2",
}
OPS = {"generate": 1, "score": None, "keep_best": 1, "aggregate": 2, "refine": None}


def parse_graph(graph: "str | list") -> list[tuple[str, int | None]]:
    """``"generate:3>score>keep_best:2"`` (or a list of ``(op, arg)``) -> ``[(op, arg)]``."""
    items = graph.split(">") if isinstance(graph, str) else list(graph)
    ops = []
    for item in items:
        if isinstance(item, str):
            name, _, text = item.strip().partition(":")
            arg = text.strip() or None
        else:
            name, arg = item
        if name not in OPS:
            raise ValueError(f"unknown GoT operation {name!r} (known: {', '.join(OPS)})")
        try:
            n = OPS[name] if arg is None else int(arg)
        except ValueError:
            raise ValueError(f"GoT operation {name} needs an integer count, got {arg!r}") from None
        if n is not None and n < 1:
            raise ValueError(f"GoT operation {name} needs a count >= 1, got {n}")
        ops.append((name, n))
    if not any(name == "generate" for name, _ in ops):
        raise ValueError("a GoT graph needs a generate operation")
    return ops


def _shown(thoughts) -> str:
    return "\n".join(f"{i}. Act: {t.step.action or '(invalid)'} -> {t.observation.strip()[:160]}"
                     for i, t in enumerate(thoughts, 1))


@register_strategy("got")
@dataclass
class GraphOfThoughts(Strategy):
    graph: Any = "default"
    value: Any = "auto"
    agg: str = "last"
    dedup: str = "state"
    temperature: float | None = None

    def __post_init__(self) -> None:
        check_dedup(self.dedup)
        if self.graph != "default":
            parse_graph(self.graph)
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg must be one of {', '.join(AGGREGATIONS)}, got {self.agg!r}")
        check_value(self.value, ("auto", "rm", "heuristic", "lm", "logprob"))

    async def run(self, ctx: SearchContext) -> None:
        graph = parse_graph(GRAPHS.get(ctx.task.env, GRAPHS["*"]) if self.graph == "default" else self.graph)
        value = make_value(self.value, ctx, self.agg)
        thoughts = [ctx.root]
        while any(ctx.expandable(t) for t in thoughts):
            for op, n in graph:
                thoughts = await getattr(self, op)(ctx, thoughts, n, value)

    # --- the operations: thoughts in, thoughts out ---------------------------------------------
    async def generate(self, ctx, thoughts, k, value):
        live = [t for t in thoughts if ctx.expandable(t)]
        kids = await ctx.expand(live, k, temperature=self.temperature, dedup=engine_dedup(self.dedup))
        return dedup_nodes(ctx, [t for t in thoughts if not ctx.expandable(t)] + [c for cs in kids for c in cs],
                           self.dedup)

    async def score(self, ctx, thoughts, _, value):
        remember(ctx, thoughts, await value(ctx, thoughts))
        return thoughts

    async def keep_best(self, ctx, thoughts, n, value):
        values = ctx.values
        return keep_best(ctx, thoughts, [values.get(t.id, 0.0) for t in thoughts], n, "not kept",
                         order="value")

    async def aggregate(self, ctx, thoughts, n, value):
        values = ctx.values
        best = sorted((t for t in thoughts if t.parent is not None),
                      key=lambda t: -values.get(t.id, 0.0))[:n]
        if len(best) < 2:
            return thoughts
        note = ("Several candidate steps were considered:\n" + _shown(best)
                + "\nCombine what they got right into one better next step.")
        return dedup_nodes(ctx, thoughts + await self._derive(ctx, [best], [note]), self.dedup)

    async def refine(self, ctx, thoughts, _, value):
        live = [t for t in thoughts if t.parent is not None and ctx.expandable(t)]
        notes = [f"A previous attempt from this state was:\n{_shown([t])}\nImprove on it."
                 for t in live]
        return dedup_nodes(ctx, thoughts + await self._derive(ctx, [[t] for t in live], notes), self.dedup)

    async def _derive(self, ctx, groups, notes):
        """One new thought per group: a step from the group's first thought's parent state,
        prompted with ``note``, with an edge from every thought of the group."""
        parents = [ctx.tree.nodes[g[0].parent] for g in groups]
        kids = await ctx.expand(parents, 1, temperature=self.temperature, notes=notes)
        out = []
        for group, new in zip(groups, kids):
            for child in new:
                for source in group:
                    ctx.tree.add_merge_edge(source, child)
            out += new
        return out

    def select(self, ctx: SearchContext):
        return best_answer(ctx)
