"""The fast paths of the search's hot loop give exactly what the plain code gave.

Pins the equivalences the speed-ups rely on: the arithmetic env's number parsing and printing,
its cached observation, the engine's prompt ids, MCTS's backup along parent links and the
value sources' ``last`` shortcut.
"""
from __future__ import annotations

import random
from fractions import Fraction
from types import SimpleNamespace

import pytest

import omrl_search as om
from envs.arith import _number, fmt
from helpers import Recording
from omrl_search.env import make_env, stable_hash
from omrl_search.reward import aggregate
from strategies.values import LogprobValue, step_prob


@pytest.mark.parametrize("token", ["0", "7", "-5", "13", "8/3", "-8/3", "4/2", "-0/5", "10/4",
                                   "0/7", "123456789/3", "\u0663"])
def test_number_tokens_read_like_fraction(token):
    assert _number(token) == Fraction(token) and type(_number(token)) is Fraction


@pytest.mark.parametrize("token", ["1/0", "-3/0"])
def test_zero_denominator_raises_like_fraction(token):
    with pytest.raises(ZeroDivisionError):
        Fraction(token)
    with pytest.raises(ZeroDivisionError):
        _number(token)


@pytest.mark.parametrize("x", [0, 24, -5, Fraction(8, 3), Fraction(-1, 3), Fraction(6, 2), True, 0.5])
def test_fmt_prints_like_a_fraction(x):
    assert fmt(x) == str(Fraction(x))


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_cached_observations_match_a_fresh_env(name):
    """Random play with restores: every observation (step, snapshot, observe) equals what an
    env that never saw the state before shows, and state keys are the plain hash."""
    rng = random.Random(0)
    env, fresh = make_env(name), make_env(name)
    for task in om.load_tasks(name, "test", limit=5):
        env.reset(task)
        snaps = [env.snapshot()]
        for _ in range(40):
            start = rng.choice(snaps)
            env.restore(start)
            assert env.observe() == start.observation
            actions = env.valid_actions() or ["answer 1 + 2"]
            res = env.step(rng.choice(actions + ["1 / 0", "99 * 99", "answer (1 + 2"]))
            snap = env.snapshot()
            fresh.restore(snap)
            assert snap.observation == env.observe() == fresh.observe()
            assert res.observation == snap.observation or start.payload.done
            assert snap.state_key == stable_hash(fresh.position())
            snaps.append(snap)


def test_prompt_ids_are_the_path_concatenation():
    """Each request's prompt is the ids recorded along its node's path plus the new turn."""
    policy = Recording(p=0.5)
    results = om.search_many(om.load_tasks("game24", "test", limit=3), policy=policy,
                             strategy="mcts:simulations=12,leaves=2,k=2,value=rollout")
    for r in results:
        expected = set()
        for node in r.tree.nodes:
            path = [t for n in r.tree.path(node)[1:] for t in n.step.context_ids + n.step.completion_ids]
            expected |= {tuple(path + r.tree.nodes[c].step.context_ids) for c in node.children}
        sent = [tuple(req.prompt_ids) for batch in policy.batches for req in batch
                if req.meta["task"] is r.task]
        assert sent and set(sent) <= expected


def test_mcts_backup_counts_every_simulation_at_the_root():
    results = om.search_many(om.load_tasks("game24", "test", limit=4), policy="scripted:oracle:p=0.5",
                             strategy="mcts:simulations=30,leaves=3,k=2,value=rollout", seed=1)
    for r in results:
        root = r.tree.root
        assert root.visits == sum(r.tree.nodes[c].visits for c in root.children) > 0
        for n in r.tree.nodes:
            assert 0.0 <= n.value_sum <= n.visits


@pytest.mark.parametrize("agg", ["last", "min", "mean", "prod"])
def test_value_sources_reduce_each_path_by_agg(agg):
    (result,) = om.search_many(om.load_tasks("game24", "test", limit=1), policy="scripted:oracle:p=0.5",
                               strategy="beam:width=2,k=2")
    nodes = result.tree.nodes
    ctx = SimpleNamespace(scratch={}, tree=result.tree)
    coro = LogprobValue(agg)(ctx, nodes)
    with pytest.raises(StopIteration) as done:  # logprob values never wait on the engine
        coro.send(None)
    want = [step_prob(n) if agg == "last" else
            aggregate([step_prob(m) for m in result.tree.path(n)[1:]], agg) for n in nodes]
    assert done.value.value == want
