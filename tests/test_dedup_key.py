"""Dedup keys: Game24 states keep their history apart (state keys) unless dedup merges them
(``Env.dedup_key``); envs without a dedup key of their own dedup by state key as before."""
from __future__ import annotations

import pytest

import omrl_search as om
from omrl_search.backends.scripted import ScriptedPolicy
from omrl_search.engine import Engine
from omrl_search.env import ReplayEnv, env_class, make_env
from omrl_search.tree import DUPLICATE, PRUNED, dedup_key, unique_states


def _game24(snapshots=None):
    env = make_env("game24", snapshots=snapshots)
    task = env_class("game24").task_from_dict({"numbers": [1, 1, 4, 6]})
    return env, task


def _play(env, task, actions):
    env.reset(task)
    for a in actions:
        assert env.step(a).valid, a
    return env.state_key(), env.dedup_key(), env.snapshot()


@pytest.mark.parametrize("snapshots", [None, "replay"])
def test_two_routes_to_the_same_numbers(snapshots):
    env, task = _game24(snapshots)
    assert isinstance(env, ReplayEnv) == (snapshots == "replay")
    key_a, dedup_a, snap_a = _play(env, task, ["4 * 6", "24 * 1"])  # 1 24
    key_b, dedup_b, snap_b = _play(env, task, ["1 * 1", "4 * 6"])   # 1 24
    assert key_a != key_b and dedup_a == dedup_b
    assert (snap_a.state_key, snap_a.dedup_key) == (key_a, dedup_a)
    assert (snap_b.state_key, snap_b.dedup_key) == (key_b, dedup_b)
    _, dedup_c, _ = _play(env, task, ["4 + 6", "10 * 1"])  # 1 10: another position
    assert dedup_c != dedup_a


class Script(ScriptedPolicy):
    """Plays the given actions in order, one per completion asked for."""

    name = "script"

    def __init__(self, actions):
        super().__init__()
        self.actions = iter(actions)

    def choose(self, env, rng, meta):
        return self.completion("scripted", next(self.actions)), 0.5


class Grow(om.Strategy):
    """Expands the root into two children, each of them into one; records what came back."""

    name = "grow"

    def __init__(self, dedup):
        self.dedup, self.seen = dedup, {}

    async def run(self, ctx):
        (kids,) = await ctx.expand([ctx.root], 2, dedup=self.dedup)
        self.seen["kids"] = kids
        grand = await ctx.expand(kids, 1, dedup=self.dedup)
        self.seen["grand"] = [g for gs in grand for g in gs]

    def select(self, ctx):
        return ctx.tree.nodes[-1]

    def spec(self):
        return "grow"


@pytest.mark.parametrize("dedup", [True, False])
def test_engine_expand_merges_transposed_siblings_only_with_dedup(dedup):
    env, task = _game24()
    # "1 * 1" and "1 / 1" from 1 1 4 6 both leave 1 4 6 by different paths (siblings); the
    # second expansion reaches 1 24 from each kept child
    actions = ["1 * 1", "1 / 1", "4 * 6", "4 * 6"]
    grow = Grow(dedup)
    (result,) = Engine(Script(actions)).run(grow, [task])
    assert not result.faults
    first = [result.tree.nodes[i] for i in result.tree.root.children]
    assert len(first) == 2 and first[0].state_key != first[1].state_key
    assert dedup_key(first[0]) == dedup_key(first[1])
    if dedup:
        assert grow.seen["kids"] == [first[0]]
        assert (first[1].status, first[1].error) == (PRUNED, DUPLICATE)
        assert len(grow.seen["grand"]) == 1
    else:
        assert grow.seen["kids"] == first and first[1].status != PRUNED
        grand = grow.seen["grand"]
        assert len(grand) == 2 and grand[0].state_key != grand[1].state_key
        # a frontier dedup (ToT's dedup=state, beam, GoT) merges cousins the same way
        assert unique_states(grand) == [grand[0]] and grand[1].error == DUPLICATE


def test_envs_without_their_own_dedup_key_dedup_by_state_key():
    sokoban = make_env("sokoban")
    assert not type(sokoban).own_dedup_key and type(make_env("game24")).own_dedup_key
    tasks = om.load_tasks("sokoban", "test", limit=4)
    runs = [om.search_many(tasks, strategy="mcts:simulations=30,k=3", policy="scripted:oracle:p=0.4",
                           seed=3) for _ in range(2)]
    assert [r.to_dict()["tree"] for r in runs[0]] == [r.to_dict()["tree"] for r in runs[1]]
    nodes = [n for r in runs[0] for n in r.tree.nodes]
    assert any(n.error == DUPLICATE for n in nodes)  # dedup really ran
    for n in nodes:  # no second key recorded: dedup compared state keys, as before dedup_key
        assert n.snapshot is None or n.snapshot.dedup_key == ""
        assert dedup_key(n) == n.state_key
