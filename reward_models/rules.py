"""Rule rewards, as OpenManus-RL's GRPO recipes name them, composable by weights.

* ``format`` — 1 when the step parsed as ``Think:``/``Act:`` and the env accepted the action;
* ``outcome`` — the env's success at a terminal step, 0 before;
* ``tag_count`` — 1 when the completion has exactly one ``Think:`` and one ``Act:`` line;
* ``env`` — the env's own reward for the step.

``rules:format=0.2,outcome=1`` scores each step with the weighted sum (aggregation ``last`` by
default, so a finished trajectory's value is its final step's score).
"""
from __future__ import annotations

import re
from typing import Callable

from omrl_search.reward import AGGREGATIONS, RewardModel, register_reward_model
from omrl_search.specs import parse_kv
from omrl_search.tree import Trajectory
from omrl_search.types import Step

_THINK = re.compile(r"^\s*think\s*:", re.IGNORECASE | re.MULTILINE)
_ACT = re.compile(r"^\s*act\s*:", re.IGNORECASE | re.MULTILINE)


def format_rule(step: Step) -> float:
    return 1.0 if step.valid and step.action else 0.0


def outcome_rule(step: Step) -> float:
    return 1.0 if step.done and step.success else 0.0


def tag_count_rule(step: Step) -> float:
    return 1.0 if len(_THINK.findall(step.completion)) == 1 and len(_ACT.findall(step.completion)) == 1 else 0.0


def env_rule(step: Step) -> float:
    return float(step.reward)


RULES: dict[str, Callable[[Step], float]] = {
    "format": format_rule, "outcome": outcome_rule, "tag_count": tag_count_rule, "env": env_rule}


class RuleReward(RewardModel):
    """Weighted sum of rule rewards per step."""

    def __init__(self, weights: dict[str, float], aggregation: str = "last"):
        unknown = set(weights) - set(RULES)
        if unknown:
            raise ValueError(f"unknown rule(s) {', '.join(sorted(unknown))} (known: {', '.join(RULES)})")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
        self.weights, self.aggregation = dict(weights), aggregation
        self.name = "rules:" + ",".join(f"{k}={v}" for k, v in self.weights.items())
        # outcome and env rewards read the env's own success check: a search selecting by them
        # has the verifier in the loop (its results are flagged, as best_of_n:select_by=verifier)
        self.uses_verifier = any(self.weights.get(k) for k in ("outcome", "env"))

    def score(self, prefixes: list[Trajectory]) -> list[list[float]]:
        rules = [(RULES[k], w) for k, w in self.weights.items()]
        return [[sum(w * rule(s) for rule, w in rules) for s in t.steps] for t in prefixes]


@register_reward_model("rules")
def _rules(arg: str) -> RuleReward:
    opts = parse_kv(arg, "reward model") if arg else {"format": 0.2, "outcome": 1.0}
    aggregation = opts.pop("aggregation", "last")
    bad = [f"{k}={v!r}" for k, v in opts.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise ValueError(f"rules: weights must be numbers, got {', '.join(bad)}")
    return RuleReward({k: float(v) for k, v in opts.items()}, aggregation)
