"""Step-level beam search, as in search-and-learn (Beeching et al. 2024; Snell et al. 2024,
"Scaling LLM Test-Time Compute Optimally can be More Effective than Scaling Model Parameters").

    beam <- [root]
    while beam:
        candidates <- k sampled next steps of every beam          (one batched LM call)
        drop failed and duplicate states
        score candidates with the value source, reduced along the path by agg
        keep the `width` best; finished ones leave the beam, the others form the next beam
    answer <- the best-valued finished trajectory

Knobs: ``width`` (beams kept), ``k`` (expansions per beam), ``value`` (auto | rm | heuristic |
lm | logprob, see :mod:`strategies.values`), ``agg`` (last | min | mean | prod), ``temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omrl_search.reward import AGGREGATIONS
from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import unique_states

from .values import best_answer, check_value, keep_best, make_value


@register_strategy("beam")
@dataclass
class Beam(Strategy):
    width: int = 3
    k: int = 3
    value: Any = "auto"
    agg: str = "last"
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.width < 1 or self.k < 1:
            raise ValueError(f"width and k must be >= 1, got width={self.width}, k={self.k}")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg must be one of {', '.join(AGGREGATIONS)}, got {self.agg!r}")
        check_value(self.value, ("auto", "rm", "heuristic", "lm", "logprob"))

    async def run(self, ctx) -> None:
        value = make_value(self.value, ctx, self.agg)
        beam = [ctx.root]
        while beam:
            kids = await ctx.expand(beam, self.k, temperature=self.temperature, dedup=True)
            candidates = unique_states(c for cs in kids for c in cs)
            if not candidates:
                return
            kept = keep_best(ctx, candidates, await value(ctx, candidates), self.width,
                             "below the beam")
            beam = [n for n in kept if ctx.expandable(n)]

    def select(self, ctx):
        return best_answer(ctx)
