"""Issue 39 item 1: non-finite logprobs (NaN, +inf) in a generation, and non-finite scores from
``policy.score``, are that node's counted fault in every strategy; no task is lost."""
from __future__ import annotations

import math
import random

import pytest

import omrl_search as om
from omrl_search.backends.scripted import OraclePolicy

STRATEGIES = ["react", "best_of_n:n=4", "beam:width=2,k=3", "tot",
              "mcts:simulations=12,priors=policy", "mcts:simulations=12", "dfsdt:width=2", "got"]


class NonFinite(OraclePolicy):
    """The oracle, with a NaN or +inf among the logprobs of a ``share`` of its generations
    (drawn from its own seeded stream) and, as often, among the scores of ``score``."""

    def __init__(self, share: float, p: float = 0.3):
        super().__init__(p)
        self.share, self.rng, self.spoiled = share, random.Random(7), 0

    def _spoil(self, values: list[float]) -> list[float]:
        if values and self.rng.random() < self.share:
            self.spoiled += 1
            values = list(values)
            values[self.rng.randrange(len(values))] = self.rng.choice([math.nan, math.inf])
        return values

    def generate(self, requests):
        out = super().generate(requests)
        for gens in out:
            for g in gens:
                g.logprobs = self._spoil(list(g.logprobs or [0.0]))
        return out

    def score(self, requests, completions):
        return [self._spoil(s) for s in super().score(requests, completions)]


@pytest.mark.parametrize("share", [0.15, 1.0])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_finite_logprobs_are_node_faults_and_lose_no_task(strategy, share):
    tasks = om.load_tasks("game24", "test", limit=6)
    policy = NonFinite(share)
    results = om.search_many(tasks, strategy=strategy, policy=policy, seed=1,
                             budget="lm_calls=40")
    assert policy.spoiled > 0
    assert len(results) == len(tasks)
    assert all(r.stop_reason != "error" for r in results), [r.faults[-1:] for r in results]
    faults = [f for r in results for f in r.faults]
    assert sum("not finite" in f for f in faults) == policy.spoiled  # each one counted, once
    for r in results:  # nothing non-finite reaches a node
        for node in r.tree.nodes:
            lps = node.step.logprobs if node.step is not None else None
            assert lps is None or all(math.isfinite(x) for x in lps)
            assert node.score is None or math.isfinite(node.score)
