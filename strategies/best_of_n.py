"""Best-of-N: N independent ReAct chains from the root, then one is chosen.

The N first steps are sampled in one request (``n=N``); the chains then advance together, one
batched call per depth. The answer is chosen by

* ``verifier`` — the first chain the env says succeeded (an oracle: the result is flagged
  ``verifier_in_loop``, so it is not a fair test-time figure);
* ``rm`` — the reward model's value of each chain (finished, or as far as it got when the token
  budget ran out: scoring costs only reward-model calls);
* ``vote`` — majority vote over the chains' final answers (self-consistency, Wang et al. 2023);
* ``auto`` — ``rm`` when the search has a reward model, otherwise ``vote``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omrl_search.budget import BudgetExhausted
from omrl_search.strategy import Strategy, majority_vote, register_strategy

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext

SELECTIONS = ("auto", "verifier", "rm", "vote")


@register_strategy("best_of_n")
@dataclass
class BestOfN(Strategy):
    n: int = 8
    temperature: float = 0.8
    select_by: str = "auto"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.select_by not in SELECTIONS:
            raise ValueError(f"select_by must be one of {', '.join(SELECTIONS)}, got {self.select_by!r}")
        self.verifier_in_loop = self.select_by == "verifier"

    def _mode(self, ctx) -> str:
        if self.select_by == "auto":
            return "rm" if ctx.has_reward_model else "vote"
        return self.select_by

    async def run(self, ctx: SearchContext) -> None:
        stopped = None
        try:
            (firsts,) = await ctx.expand([ctx.root], self.n, temperature=self.temperature)
            await ctx.rollout(firsts, temperature=self.temperature)
        except BudgetExhausted as exc:
            if self._mode(ctx) != "rm":
                raise
            stopped = exc  # score what the budget paid for, then report the stop
        if self._mode(ctx) == "rm":
            await ctx.evaluate([n for n in ctx.tree.leaves() if n.parent is not None])
        if stopped is not None:
            raise stopped

    def select(self, ctx: SearchContext):
        leaves = [n for n in ctx.tree.leaves() if n.parent is not None]
        if not leaves:
            return None
        mode = self._mode(ctx)
        if mode == "verifier":
            won = [n for n in leaves if n.success]
            if won:
                return won[0]
        if mode == "rm":
            scored = [n for n in leaves if n.score is not None]
            if scored:
                return max(scored, key=lambda n: n.score)
        return majority_vote(n for n in leaves if n.terminal) or leaves[0]
