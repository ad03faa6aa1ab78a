"""The reward-model contract (docs/design.md §4): ``score(prefixes) -> per-step scores``, batched.

Implementations (PRM, ORM, rules, judge) are plugins: factories listed as
``omrl_search.reward_models`` entry points (docs/design.md §7). The engine calls
:meth:`RewardModel.score` once per round for every tree's pending prefixes and reduces
per-step scores with :func:`aggregate`.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from .plugins import Registry
from .tree import Trajectory
from .types import Usage

AGGREGATIONS = ("min", "last", "prod", "mean")


def aggregate(scores: list[float], how: str) -> float:
    """Reduce per-step scores to one value (search-and-learn's conventions)."""
    if not scores:
        return 0.0
    if how == "last":
        return scores[-1]
    if how == "min":
        return min(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "prod":
        return math.prod(scores)
    raise ValueError(f"unknown aggregation {how!r} (known: {', '.join(AGGREGATIONS)})")


@dataclass(slots=True)
class Scored:
    """A reward model's answer for a batch of prefixes: per-step scores (or the exception that
    prefix raised) and the tokens it ran for each."""

    steps: "list[list[float] | Exception]"
    usage: list[Usage]


class RewardModel(ABC):
    """Scores trajectory prefixes step by step."""

    name: str = "reward_model"
    aggregation: str = "last"
    #: True when scores read the env's success check (results then say ``verifier_in_loop``)
    uses_verifier: bool = False

    @abstractmethod
    def score(self, prefixes: list[Trajectory]) -> list[list[float]]:
        """One score per step of each prefix (a prefix with no steps gets ``[]``).

        A prefix that cannot be scored (a judge answer without a score) may get an exception
        in place of its list: the engine records it as that prefix's fault and scores it 0,
        leaving the rest of the batch alone."""

    def scored(self, prefixes: list[Trajectory]) -> "Scored":
        """:meth:`score` with the tokens the model ran for each prefix, as :class:`Usage`
        records (what the engine charges to a search's ``rm_tokens``: their prefill tokens).
        Reward models that run no network (rules, env outcome) keep this default: no tokens;
        a learned one overrides it and :meth:`score` returns its ``steps``."""
        return Scored(self.score(prefixes), [Usage()] * len(prefixes))

    def value(self, prefixes: list[Trajectory]) -> list[float]:
        return [s if isinstance(s, Exception) else aggregate(s, self.aggregation)
                for s in self.score(prefixes)]


_RMS = Registry("omrl_search.reward_models", "a reward-model factory f(arg) -> RewardModel", callable)


def register_reward_model(name: str) -> Callable:
    """Decorator: register a factory ``f(arg) -> RewardModel`` under ``name`` without an entry
    point; installed ones are found through ``omrl_search.reward_models`` entry points."""

    def deco(factory: Callable[..., RewardModel]) -> Callable[..., RewardModel]:
        return _RMS.register(name, factory)

    return deco


def list_reward_models() -> list[str]:
    return _RMS.names()


def make_reward_model(spec: "str | RewardModel | None") -> RewardModel | None:
    """``"rules:format=0.2,outcome=1"``, ``"prm:PATH"``, a model (passes through), or None."""
    if spec is None or isinstance(spec, RewardModel):
        return spec
    name, _, arg = spec.partition(":")
    factory = _RMS.get(name)
    if factory is None:
        raise ValueError(f"unknown reward model {spec!r} (known: {', '.join(_RMS.names())})")
    return factory(arg)
