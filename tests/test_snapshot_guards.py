"""Snapshot guards: no silent restore across envs; state keys identify positions, not wording."""
from __future__ import annotations

import pytest

from omrl_search.env import EnvError, env_class, make_env


def test_snapshot_of_another_env_is_refused():
    soko, g24 = make_env("sokoban"), make_env("game24")
    soko.reset(env_class("sokoban").tasks("test", 1)[0])
    with pytest.raises(EnvError, match="sokoban"):
        g24.restore(soko.snapshot())


def test_same_position_by_two_routes_shares_a_state_key():
    env = make_env("game24")
    task = next(t for t in env_class("game24").tasks("test") if 4 in t.data["numbers"]
                and 6 in t.data["numbers"])
    env.reset(task)
    root = env.snapshot()
    env.step("4 * 6")
    a_key, a_obs = env.state_key(), env.observe()
    env.restore(root)
    env.step("6 * 4")
    assert env.state_key() == a_key  # same numbers left, same step count
    assert env.observe() != a_obs  # but each observation shows its own last operation
