"""One budget door (issue 40 item 2): parsed in one place, every cost charged through one named
operation per kind, each adding through ``Budget.charge``."""
from __future__ import annotations

from collections import Counter

import pytest

import omrl_search as om
from omrl_search import api
from omrl_search.budget import Budget
from omrl_search.specs import SpecError


@pytest.mark.parametrize("spec", ["tokens=nan", "tokens=inf", {"env_steps": float("nan")},
                                  {"lm_calls": float("inf")}, "tokens=0", "tokenz=5", {"seconds": -1}])
def test_a_bad_budget_is_refused_whichever_way_it_comes_in(spec):
    with pytest.raises(SpecError, match="budget|tokenz"):
        Budget.parse(spec)
    with pytest.raises(SpecError):
        api.parse_budget(spec)
    if isinstance(spec, dict):
        with pytest.raises(SpecError):
            Budget(spec)


def test_the_api_reads_budgets_through_the_one_door():
    assert api.parse_budget == Budget.parse  # the same classmethod, not a second parser
    assert Budget.parse("tokens=20000,env_steps=5").limits == {"tokens": 20000, "env_steps": 5}


@pytest.mark.parametrize("strategy,rm", [("mcts:simulations=10,priors=policy", "rules:format=0.2,outcome=1"),
                                         ("beam:width=2,k=3", "rules:format=0.2,outcome=1"),
                                         ("tot", None)])
def test_every_cost_goes_through_budget_charge_by_a_named_operation(monkeypatch, strategy, rm):
    """Summing what ``Budget.charge`` was asked equals what the searches report spent: nothing
    adds to a budget behind its door. And each kind came through its named operation."""
    charged: dict[int, Counter] = {}
    named: Counter = Counter()
    charge = Budget.charge

    def logged(self, **kw):
        charged.setdefault(id(self.spent), Counter()).update(kw)
        charge(self, **kw)

    monkeypatch.setattr(Budget, "charge", logged)
    for name in ("charge_lm", "charge_scoring", "charge_rm", "charge_env_step"):
        op = getattr(Budget, name)
        monkeypatch.setattr(Budget, name, lambda self, *a, _op=op, _n=name, **k: (named.update([_n]), _op(self, *a, **k))[1])
    results = om.search_many(om.load_tasks("game24", "test", limit=4), strategy=strategy,
                             policy="scripted:oracle:p=0.4", reward_model=rm, seed=2)
    spent = Counter()
    for r in results:
        for kind in ("prompt_tokens", "completion_tokens", "lm_calls", "rm_calls", "rm_tokens", "env_steps"):
            spent[kind] += r.spent[kind]
    total = Counter()
    for c in charged.values():
        total.update(c)
    assert spent["lm_calls"] > 0 and spent["env_steps"] > 0
    for kind in ("prompt_tokens", "completion_tokens", "lm_calls", "rm_calls", "env_steps"):
        assert total[kind] == spent[kind], kind
    assert named["charge_lm"] + named["charge_scoring"] == spent["lm_calls"]
    assert named["charge_env_step"] == spent["env_steps"] and named["charge_rm"] == spent["rm_calls"]
    assert (named["charge_rm"] > 0) == (rm is not None)
    assert (named["charge_scoring"] > 0) == ("priors=policy" in strategy)
