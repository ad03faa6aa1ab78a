"""Prompt tokens budgeted honestly: ``prefill_tokens`` (computed) and ``cached_tokens`` (served by a
backend's prefix cache) charged from each Generation, as limits and in what a search spent."""
from __future__ import annotations

import pytest

import omrl_search as om
from helpers import PartlyCached
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.budget import KINDS, Budget, BudgetExhausted
from omrl_search.specs import SpecError
from omrl_search.types import Generation

TASKS = om.load_tasks("game24", "test", limit=6)


def gen(prompt: int, cached: int, completion: int = 5) -> Generation:
    return Generation("x", [1] * completion, None, prompt, completion, cached_tokens=cached)


def test_charge_lm_splits_prompt_tokens() -> None:
    b = Budget()
    b.charge_lm([gen(100, 80), gen(100, 80, 7)])  # n=2: the prompt once, from the first sample
    b.charge_lm([gen(50, 0)])
    b.charge_lm()  # a failed call
    s = b.spent
    assert (s.prompt_tokens, s.cached_tokens, s.prefill_tokens) == (150, 80, 70)
    assert s.completion_tokens == 17 and s.tokens == 167 and s.lm_calls == 3
    d = s.as_dict()
    assert d["prefill_tokens"] + d["cached_tokens"] == d["prompt_tokens"] == 150
    assert d["tokens"] == 167  # tokens still count every prompt token, cached or not


def test_cached_tokens_clamped_to_the_prompt() -> None:
    b = Budget()
    b.charge_lm([gen(10, 25)])  # a backend that over-reports cannot make prefill negative
    b.charge_lm([gen(10, -3)])
    assert (b.spent.cached_tokens, b.spent.prefill_tokens) == (10, 10)
    b.charge(prompt_tokens=30)  # charged without a cache figure: all prefill
    assert b.spent.prefill_tokens == 40


def test_new_kinds_are_limits() -> None:
    assert {"prefill_tokens", "cached_tokens"} <= set(KINDS)
    b = Budget.parse("prefill_tokens=100")
    b.charge_lm([gen(1000, 950)])
    assert b.exhausted() is None  # 50 computed
    b.charge_lm([gen(1000, 940)])
    assert b.exhausted() == "prefill_tokens"
    with pytest.raises(BudgetExhausted) as e:
        b.check()
    assert e.value.stop_reason == "budget:prefill_tokens"
    c = Budget.parse({"cached_tokens": 500})
    c.charge_lm([gen(1000, 499)])
    assert c.exhausted() is None
    c.charge_lm([gen(10, 1)])
    assert c.exhausted() == "cached_tokens"
    with pytest.raises(SpecError):
        Budget.parse("prefill_tokens=0")


def test_search_spends_and_stops_on_prefill_tokens() -> None:
    free = om.search_many(TASKS, strategy="best_of_n:n=4", policy=PartlyCached(0.3, divisor=2), seed=1)
    for r in free:
        s = r.spent
        assert s["prefill_tokens"] + s["cached_tokens"] == s["prompt_tokens"] > 0
        assert s["cached_tokens"] >= s["prompt_tokens"] // 2 - s["lm_calls"]
    plain = om.search_many(TASKS, strategy="best_of_n:n=4", policy=OraclePolicy(0.3), seed=1)
    assert all(r.spent["cached_tokens"] == 0 and r.spent["prefill_tokens"] == r.spent["prompt_tokens"]
               for r in plain)
    # a prefill limit below what a search needs stops it, after at most one batch past it
    need = min(r.spent["prefill_tokens"] for r in free)
    per_call = max(r.spent["prefill_tokens"] / r.spent["lm_calls"] for r in free)
    limit = max(1, need // 2)
    cut = om.search_many(TASKS, strategy="best_of_n:n=4", policy=PartlyCached(0.3, divisor=2), seed=1,
                         budget={"prefill_tokens": limit})
    stopped = [r for r in cut if r.stop_reason == "budget:prefill_tokens"]
    assert stopped
    for r in stopped:
        assert limit <= r.spent["prefill_tokens"] < limit + 4 * per_call
