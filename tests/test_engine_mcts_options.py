"""MCTS options read against LATS and rStar (docs/strategies.md): UCT selection and LATS's stop
once a rollout or a valued node ends solved."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import omrl_search as om
from omrl_search.tree import Node
from helpers import fake_ctx
from strategies.mcts import MCTS, MCTSState

TASKS = om.load_tasks("game24", "test", limit=6)


def _fan(children):
    """A root with ``children`` as ``(visits, value_sum)``, each prior 1/n, as a search's ctx."""
    root = Node(0, None, 0, "root", visits=10, value_sum=5.0)
    kids = [Node(i + 1, 0, 1, f"c{i}", visits=v, value_sum=q, prior=1 / len(children))
            for i, (v, q) in enumerate(children)]
    tree = SimpleNamespace(nodes=[root, *kids])
    return fake_ctx(tree=tree, state=MCTSState(kids={0: kids})), kids


@pytest.mark.parametrize("rule,want", [("uct", 1), ("puct", 0)])
def test_selection_rule(rule, want):
    """UCT: Q + c * sqrt(ln N / n) picks the rarely tried child (1.52 against 1.48 and 1.51);
    PUCT with equal priors picks the best mean (0.98 against 0.53 and 0.96)."""
    ctx, kids = _fan([(5, 4.0), (1, 0.0), (4, 3.0)])
    leaf, path = MCTS(rule=rule)._descend(ctx)
    assert leaf is kids[want] and path == [ctx.tree.nodes[0], kids[want]]
    ucts = [q / v + math.sqrt(math.log(10) / v) for v, q in [(5, 4.0), (1, 0.0), (4, 3.0)]]
    assert max(range(3), key=ucts.__getitem__) == 1


def test_uct_tries_an_unvisited_child_first():
    ctx, kids = _fan([(5, 5.0), (3, 3.0), (0, 0.0), (0, 0.0)])
    leaf, _ = MCTS(rule="uct")._descend(ctx)
    assert leaf is kids[2]  # the first unvisited one, whatever the others' values


def test_rule_is_checked():
    with pytest.raises(ValueError, match="rule must be puct or uct"):
        MCTS(rule="ucb")


def test_uct_searches_run_and_are_deterministic():
    spec = "mcts:rule=uct,simulations=40,leaves=2,k=2,value=rollout"
    a = om.search_many(TASKS, strategy=spec, policy="scripted:oracle:p=0.4", seed=3)
    b = om.search_many(TASKS, strategy=spec, policy="scripted:oracle:p=0.4", seed=3)
    assert [r.to_dict()["tree"] for r in a] == [r.to_dict()["tree"] for r in b]
    puct = om.search_many(TASKS, strategy=spec.replace("rule=uct", "rule=puct"),
                          policy="scripted:oracle:p=0.4", seed=3)
    assert [r.to_dict()["tree"] for r in a] != [r.to_dict()["tree"] for r in puct]


def test_stop_on_success_ends_at_the_first_solved_rollout():
    spec = "mcts:simulations=200,leaves=2,k=2,value=rollout"
    full = om.search_many(TASKS, strategy=spec, policy="scripted:oracle:p=0.2", seed=1)
    early = om.search_many(TASKS, strategy=spec + ",stop_on_success=true",
                           policy="scripted:oracle:p=0.2", seed=1)
    stopped = 0
    for f, e in zip(full, early):
        assert e.verifier_in_loop
        if e.success:  # the answer is the solved terminal it stopped at
            best = e.tree.nodes[e.best]
            assert best.terminal and best.success
            stopped += e.tree.root.visits < f.tree.root.visits
        else:  # never solved: it ran its simulations like the full search
            assert e.tree.root.visits == f.tree.root.visits
    assert stopped  # a solved search really stopped early


def test_solver_closes_proven_losses_so_simulations_reach_unseen_actions():
    """Countdown level 1 (two steps, every action listed and scored): a policy that puts most
    of its prior on wrong actions makes PUCT re-choose the same failed ends until the
    simulations run out; with solver=true a failed end leaves the selection, the tree is
    searched through, and every task is solved (the same searches, seeded, both times)."""
    tasks = om.load_tasks("countdown", "test:level=1", limit=8)

    def run(spec):
        return om.search_many(tasks, strategy=spec, policy="scripted:oracle:p=0.95", seed=0,
                              budget="lm_calls=40")

    plain = run("mcts:priors=policy,simulations=64")
    solver = run("mcts:priors=policy,simulations=64,solver=true")
    assert sum(r.success for r in plain) < sum(r.success for r in solver)
    full = run("mcts:priors=policy,simulations=400,solver=true,stop_on_success=true")
    assert all(r.success and r.verifier_in_loop for r in full)
    again = run("mcts:priors=policy,simulations=400,solver=true,stop_on_success=true")
    assert [r.to_dict()["tree"] for r in full] == [r.to_dict()["tree"] for r in again]


def _mcts_runs(split, budget, stops=("false", "true")):
    tasks = om.load_tasks("countdown", split, limit=16)
    return [om.search_many(tasks, policy="scripted:oracle:p=0.9", seed=0, budget=budget,
                           strategy="mcts:priors=policy,simulations=400,solver=true,"
                                    f"value=rollout,stop_on_success={stop}")
            for stop in stops]


def _wins_found(results):
    return [any(n.terminal and n.success for n in r.tree.nodes) for r in results]


def test_a_win_found_in_the_round_the_budget_ends_is_the_answer():
    """On tasks 1 and 11 the search reaches its only win in a rollout of the round its budget
    runs out in, so the stop test never sees it; the answer is still that win (both with and
    without stop_on_success: the trees are the same). Before, it followed the most visited
    children to a failure and reported none."""
    for results in _mcts_runs("test:level=3", "lm_calls=45"):
        found = _wins_found(results)
        assert [i for i, f in enumerate(found) if f] == [1, 11]
        for r, f in zip(results, found):
            assert r.success == f and r.verifier_in_loop
            if f:
                best = r.tree.nodes[r.best]
                assert best.terminal and best.success


def test_solver_going_on_keeps_the_win_it_found_as_the_answer():
    """solver=true, stop_on_success=false (a search that goes on to value its tree, e.g. for Q
    labels): it goes on past its first win, and that win stays its answer."""
    on, stop = _mcts_runs("test:level=2", "lm_calls=60")
    went_on = 0
    for r, s, f in zip(on, stop, _wins_found(on)):
        assert r.success == f
        if s.success:
            assert r.success and r.tree.nodes[r.best].success
            went_on += r.tree.root.visits > s.tree.root.visits
    assert went_on >= 2


def test_evaluate_best_values_one_new_child_per_grown_leaf():
    """evaluate=best (AlphaZero's one evaluation per simulation): a PRM values only the most
    probable new child of each grown leaf instead of all of them, so a search with many actions
    per state (priors=policy on Countdown) calls it far less for the same simulations."""
    tasks = om.load_tasks("countdown", "test:level=2", limit=4)

    def run(evaluate):
        return om.search_many(tasks, policy="scripted:oracle:p=0.5", seed=0,
                              reward_model="rules:format=0.2,outcome=1",
                              strategy=f"mcts:priors=policy,simulations=12,leaves=1,value=rm,"
                                       f"evaluate={evaluate}")

    every, best = run("all"), run("best")
    for a, b in zip(every, best):
        # one value per grown leaf, or per finished leaf reached as a leaf itself
        grown = sum(1 for n in b.tree.nodes if n.children)
        ends = sum(1 for n in b.tree.nodes if n.terminal and n.visits > 0)
        assert 0 < b.spent["rm_calls"] <= grown + ends
        assert a.spent["rm_calls"] >= 3 * b.spent["rm_calls"]
    with pytest.raises(ValueError, match="evaluate must be auto, all or best"):
        MCTS(evaluate="some")
