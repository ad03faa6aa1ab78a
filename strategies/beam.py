"""Step-level beam search, as in search-and-learn (Beeching et al. 2024; Snell et al. 2024,
"Scaling LLM Test-Time Compute Optimally can be More Effective than Scaling Model Parameters").

    beam <- [root]
    while beam:
        candidates <- k sampled next steps of every beam          (one batched LM call)
                      (propose=policy: for a beam whose env lists at most max_actions valid
                       actions, the k the policy scores highest, all scored in one call)
        drop failed nodes and repeats (dedup: state, the default | text | none)
        score candidates with the value source, reduced along the path by agg
        keep the `width` best; finished ones leave the beam, the others form the next beam
    answer <- the best-valued finished trajectory

Knobs: ``width`` (beams kept), ``k`` (expansions per beam), ``value`` (auto | rm | heuristic |
lm | logprob, see :mod:`strategies.values`), ``agg`` (last | min | mean | prod), ``temperature``,
``propose`` (sample | policy), ``max_actions`` and ``dedup`` (state | text | none). The kept
beams stay in the order they were proposed (search-and-learn keeps its beams in index order).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from omrl_search.reward import AGGREGATIONS
from omrl_search.strategy import Strategy, register_strategy
from .values import (best_answer, check_dedup, check_value, dedup_nodes, engine_dedup, keep_best,
                     make_value, scored_actions)

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext


@register_strategy("beam")
@dataclass
class Beam(Strategy):
    width: int = 3
    k: int = 3
    value: Any = "auto"
    agg: str = "last"
    temperature: float | None = None
    propose: str = "sample"
    max_actions: int = 32
    dedup: str = "state"

    def __post_init__(self) -> None:
        if self.width < 1 or self.k < 1:
            raise ValueError(f"width and k must be >= 1, got width={self.width}, k={self.k}")
        if self.propose not in ("sample", "policy") or self.max_actions < 1:
            raise ValueError(f"propose must be sample or policy and max_actions >= 1, got "
                             f"propose={self.propose!r}, max_actions={self.max_actions}")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg must be one of {', '.join(AGGREGATIONS)}, got {self.agg!r}")
        check_value(self.value, ("auto", "rm", "heuristic", "lm", "logprob"))
        check_dedup(self.dedup)

    async def run(self, ctx: SearchContext) -> None:
        if self.propose == "policy" and not ctx.can_score:
            raise ValueError(f"beam:propose=policy needs a policy that scores completions "
                             f"(Policy.score); {ctx.policy_name!r} does not")
        value = make_value(self.value, ctx, self.agg)
        beam = [ctx.root]
        while beam:
            kids = await self._propose(ctx, beam)
            candidates = dedup_nodes(ctx, chain.from_iterable(kids), self.dedup)
            if not candidates:
                return
            kept = keep_best(ctx, candidates, await value(ctx, candidates), self.width,
                             "below the beam", order="proposal")
            beam = [n for n in kept if ctx.expandable(n)]

    async def _propose(self, ctx, beam):
        """k children per beam: sampled, or (propose=policy) its k best-scored valid actions."""
        dedup = engine_dedup(self.dedup)
        if self.propose == "sample":
            return await ctx.expand(beam, self.k, temperature=self.temperature, dedup=dedup)
        scored = await scored_actions(ctx, beam, self.max_actions)
        sample = [n for n in beam if n.id not in scored]
        sampled = iter(await ctx.expand(sample, self.k, temperature=self.temperature, dedup=dedup)
                       if sample else [])
        kids = []
        for n in beam:
            if n.id in scored:
                best = sorted(scored[n.id], key=lambda item: -item[1])[:self.k]
                kids.append(ctx.apply(n, [text for text, _ in best], dedup=dedup))
            else:
                kids.append(next(sampled))
        return kids

    def select(self, ctx: SearchContext):
        return best_answer(ctx)
