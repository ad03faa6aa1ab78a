"""Data model: JSON round trips through the pydantic-validated loaders, trajectories, budgets."""
from __future__ import annotations

import json

import pytest

import omrl_search as om
from omrl_search.result import read_results, write_results
from omrl_search.specs import SpecError

TASKS = om.load_tasks("game24", "test", limit=8)


def test_search_result_json_round_trip(tmp_path):
    results = om.search_many(TASKS, strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3")
    path = tmp_path / "results.jsonl"
    write_results(path, results)
    back = list(read_results(path))
    assert [r.to_dict() for r in back] == [r.to_dict() for r in results]
    r = back[0]
    assert isinstance(r.task, om.Task) and isinstance(r.tree.nodes[1].step, om.Step)
    assert r.best_trajectory.segments() == results[0].best_trajectory.segments()
    assert len(r.tree.graph) == len(r.tree.nodes)


def test_bad_results_file_names_file_and_line(tmp_path):
    results = om.search_many(TASKS[:2], strategy="react", policy="scripted:oracle")
    path = tmp_path / "results.jsonl"
    write_results(path, results)
    lines = path.read_text().splitlines()
    broken = json.loads(lines[1])
    broken["tree"]["nodes"][1]["depth"] = "deep"
    path.write_text(lines[0] + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(ValueError, match=r"results.jsonl:2: "):
        list(read_results(path))


def test_trajectory_messages_alternate():
    r = om.search(TASKS[0], strategy="react", policy="scripted:oracle")
    msgs = r.best_trajectory.messages("instruction")
    assert [m["role"] for m in msgs] == ["user"] + ["assistant", "user"] * len(r.best_trajectory.steps)
    assert msgs[1]["content"].startswith("Think:")


def test_budget_parsing():
    b = om.Budget.parse("tokens=100,env_steps=3")
    assert b.limits == {"tokens": 100, "env_steps": 3}
    b.charge(prompt_tokens=60, completion_tokens=40)
    assert b.exhausted() == "tokens"
    with pytest.raises(om.BudgetExhausted):
        b.check()
    for bad in ("tokens=0", "flops=3", "tokens", "tokens=abc"):
        with pytest.raises(SpecError):
            om.Budget.parse(bad)
    assert om.Budget.parse(b).spent.tokens == 0  # a fresh copy of the limits


def test_aggregations():
    assert om.aggregate([0.5, 0.2, 0.9], "min") == 0.2
    assert om.aggregate([0.5, 0.2, 0.9], "last") == 0.9
    assert om.aggregate([0.5, 0.5], "prod") == 0.25
    assert om.aggregate([0.5, 1.0], "mean") == 0.75
    with pytest.raises(ValueError):
        om.aggregate([1.0], "max")


def test_unique_states_keeps_the_first_of_each_state():
    from omrl_search.tree import DUPLICATE, FAILED, PRUNED, Node, unique_states

    def node(i, key, status="open"):
        return Node(i, 0, 1, "", state_key=key, status=status)

    a, b, c, bad, old, d = (node(1, "x"), node(2, "y"), node(3, "x"), node(4, "", FAILED),
                            node(5, "z", PRUNED), node(6, "w"))
    assert unique_states([a, b, c, bad, old]) == [a, b]
    assert (c.status, c.error) == (PRUNED, DUPLICATE) and bad.status == FAILED and old.error == ""
    seen = {"w"}  # e.g. the states of a node's existing children
    e, f = node(7, "y"), node(8, "v")
    assert unique_states([d, e, bad, f], seen, keep_failed=True) == [e, bad, f]
    assert d.status == PRUNED and seen == {"w", "y", "v"}


def test_charge_lm_counts_one_call_the_prompt_once_and_every_completion():
    b = om.Budget()
    gens = [om.Generation("a", [1], None, 10, 3), om.Generation("b", [2], None, 10, 4)]
    b.charge_lm(gens)
    b.charge_lm()  # a failed request still cost a call
    assert (b.spent.lm_calls, b.spent.prompt_tokens, b.spent.completion_tokens) == (2, 10, 7)


def test_default_completion_tokens_come_from_one_place():
    from omrl_search.backends.scripted import OraclePolicy
    from omrl_search.types import DEFAULT_MAX_TOKENS

    assert om.Engine(OraclePolicy()).sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert om.SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
