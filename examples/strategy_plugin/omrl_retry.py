"""retry: a strategy plugin for omrl-search. One greedy chain whose invalid steps are retried.

    node <- root
    while node can be expanded:
        sample a step from node (greedy first, then at `temperature`), at most 1 + `retries`
        times, until one is valid
        node <- the last step sampled
    answer <- node

A strategy is a dataclass (its fields are the spec's knobs: ``retry:retries=3``) with
``async def run(ctx)`` growing the tree through the context's batched primitives.
"""
from __future__ import annotations

from dataclasses import dataclass

from omrl_search.strategy import Strategy
from omrl_search.tree import FAILED


@dataclass
class GreedyRetry(Strategy):
    retries: int = 2
    temperature: float = 0.7

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    async def run(self, ctx) -> None:
        node = ctx.root
        while ctx.expandable(node):
            child = None
            for attempt in range(1 + self.retries):
                temperature = 0.0 if attempt == 0 else self.temperature
                (kids,) = await ctx.expand([node], 1, temperature=temperature)
                child = kids[0] if kids else None
                if child is not None and child.status != FAILED and child.step.valid:
                    break
            if child is None or child.status == FAILED:
                break
            node = child
        ctx.answer = node

    def select(self, ctx):
        return ctx.answer or ctx.tree.nodes[-1]
