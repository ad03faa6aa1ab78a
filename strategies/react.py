"""ReAct (Yao et al., 2023): one chain of Think/Act/Observation turns until the episode ends.

The baseline every search strategy is compared against. Greedy by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omrl_search.strategy import Strategy, register_strategy

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext


@register_strategy("react")
@dataclass
class ReAct(Strategy):
    temperature: float = 0.0

    async def run(self, ctx: SearchContext) -> None:
        await ctx.rollout([ctx.root], temperature=self.temperature)
