"""Household (TextWorld): game building and caching, splits, text, invalid and losing actions,
native snapshots (copy-on-write, the lean progression copy), the expert from detours, the oracle."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import pytest

from envs import _textworld_games as tw
from envs._optional import MissingPackage
from envs.household import HouseholdEnv
from omrl_search.api import search_many
from omrl_search.env import TaskFileError, make_env

TEST = HouseholdEnv.tasks("test")


def _env(task=None) -> HouseholdEnv:
    env = make_env("household")
    env.reset(task or TEST[0])
    return env


def test_splits_are_disjoint_and_grow_in_size():
    train = HouseholdEnv.tasks("train")
    assert (len(train), len(TEST)) == (400, 20)
    assert not {t.seed for t in train} & {t.seed for t in TEST}
    assert HouseholdEnv.tasks("test", limit=3) == TEST[:3]
    assert [(t.data["quest"], t.data["level"]) for t in TEST[:4]] == [
        ("treasure", 1), ("cooking", 1), ("treasure", 2), ("cooking", 2)]
    pairs = [(t.data["quest"], t.data["level"]) for t in TEST]
    assert sorted(set(pairs)) == sorted((q, lv) for q in tw.QUESTS for lv in tw.LEVELS)
    assert all(pairs.count(p) == 2 for p in pairs)
    assert "5 rooms" in TEST[0].instruction and "recipe" in TEST[1].instruction
    with pytest.raises(ValueError, match="unknown split"):
        HouseholdEnv.tasks("valid")


def test_games_are_built_once_and_deterministically(tmp_path, monkeypatch):
    spec = tw.GameSpec("treasure", 1, 100_000, "test")
    shared = tw.game_file(spec)  # the default cache (built by the first reset of TEST[0])
    assert shared.endswith("treasure-level3-test-s100000.z8")
    monkeypatch.setenv("OMRL_CACHE", str(tmp_path))
    fresh = tw.game_file(spec)
    assert fresh.startswith(str(tmp_path)) and fresh != shared
    mtime = os.stat(fresh).st_mtime_ns
    assert tw.game_file(spec) == fresh and os.stat(fresh).st_mtime_ns == mtime  # not rebuilt
    def load(path):  # the game, less the absolute path of the textworld install that built it
        game = json.loads(open(path[:-3] + ".json").read())
        game["KB"].pop("text_grammars_path", None)
        return game

    assert load(fresh) == load(shared)  # same seed, same game
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".build-")]


def test_first_observation_is_the_intro_with_commands():
    env = _env()
    obs = env.observe()
    from textworld.generator.game import Game

    objective = Game.load(env._game.path[:-3] + ".json").objective
    assert obs.startswith(objective)
    assert "$$" not in obs and "\n>" not in obs and "-= " in obs  # no banner or prompt; a room
    assert obs.endswith(f"Available commands: {', '.join(env.valid_actions())}.")
    assert env.expert_action() in env.valid_actions()
    result = env.step(f"  {env.expert_action().upper()}. ")  # forgiving about case and dots
    assert result.valid and result.info == {"score": 0, "max_score": 1} and not result.done


def test_invalid_actions_leave_the_game_untouched():
    env = _env(TEST[1])
    ram, expert, key = env._game.ram(), env.expert_action(), env.state_key()
    result = env.step("eat the house")
    assert result.valid is False and not result.done and result.reward == 0.0
    assert result.observation.startswith("Invalid action: 'eat the house' is not one of the available")
    assert HouseholdEnv.action_help in result.observation and "Available commands:" in result.observation
    assert env._game.ram() == ram and env.expert_action() == expert and env.state_key() != key
    assert env.step("").observation.startswith("Invalid action: empty action.")


def test_eating_an_ingredient_loses_the_cooking_game():
    env = _env(TEST[1])  # one ingredient, one room
    env.step(next(a for a in env.valid_actions() if a.startswith("take") and "cookbook" not in a))
    eat = next(a for a in env.valid_actions() if a.startswith("eat "))
    result = env.step(eat)
    assert result.terminated and not result.truncated and result.reward == 0.0  # lost: an end state
    assert result.success is False and result.info["answer"] == "lost"
    assert "You lost" in result.observation and env.expert_action() is None
    assert env.step("look").observation == "Invalid action: the episode is over."


def test_lean_progression_copy_matches_textworld_copy():
    env = _env(TEST[3])  # cooking: a detour, then the winning policy
    original = env._game.tracker._game_progression
    facts, policy = set(original.state.facts), original.winning_policy
    ours, theirs = tw.copy_progression(original), original.copy()
    detour = next(a for a in ours.valid_actions if a.name.startswith(("open", "go")))
    for action in (detour, *policy[:3]):
        ours.update(action)
        theirs.update(action)
        assert ours.winning_policy == theirs.winning_policy
        assert set(ours.state.facts) == set(theirs.state.facts)
        assert ours.valid_actions == theirs.valid_actions
    assert ours.winning_policy != policy  # it did move on...
    assert set(original.state.facts) == facts and original.winning_policy == policy  # ...alone


def test_snapshots_are_copy_on_write():
    env = _env(TEST[3])
    first = env.expert_action()
    snap = env.snapshot()
    progression = snap.payload[1][1]
    facts = set(progression.state.facts)
    assert env._game.tracker._game_progression is progression  # shared until the next step
    for _ in range(3):
        env.step(env.expert_action())
    assert env._game.tracker._game_progression is not progression
    assert set(progression.state.facts) == facts
    env.restore(snap)
    assert (env.observe(), env.state_key()) == (snap.observation, snap.state_key)
    assert env.expert_action() == first


def test_expert_recovers_from_detours():
    rng = random.Random(0)
    for task in TEST[:6]:
        env = _env(task)
        for _ in range(3):  # harmless detours: walking, looking, opening (never taking or eating)
            safe = [a for a in env.valid_actions() if a.split()[0] in ("go", "examine", "look", "open")]
            env.step(rng.choice(safe))
        result = None
        for _ in range(40):
            result = env.step(env.expert_action())
            if result.done:
                break
        assert result.success, task.task_id


def test_oracle_solves_test_tasks_in_process():
    results = search_many(TEST[:4], strategy="react", policy="scripted:oracle:p=0")
    assert all(r.success for r in results) and not any(r.faults for r in results)
    results = search_many(TEST[:2], strategy="mcts", policy="scripted:oracle:p=0.3", seed=1)
    assert all(r.success for r in results) and not any(r.faults for r in results)


def test_task_rows(tmp_path):
    game = tw.game_file(tw.GameSpec("treasure", 1, 100_000, "test"))
    rows = [{"quest": "cooking", "level": 2, "seed": 7}, {"game_file": game, "task_id": "mine"}]
    path = tmp_path / "games.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    generated, given = HouseholdEnv.load_tasks(path)
    assert generated.task_id == "household-cooking2-test-s7" and generated.data["level"] == 2
    assert given.task_id == "mine" and _env(TEST[0]).observe().startswith(given.instruction)
    env = _env(given)
    assert env.expert_action() == _env(TEST[0]).expert_action()
    for bad, reason in [({"quest": "garden", "level": 1, "seed": 1}, "quest must be one of"),
                        ({"quest": "cooking", "level": 9, "seed": 1}, "level must be one of"),
                        ({"quest": "cooking", "level": 1, "seed": -1}, "seed must be"),
                        ({"game_file": str(tmp_path / "none.z8")}, "must both exist"),
                        ({"quest": "cooking", "level": 1, "seed": 1, "max_steps": 0}, "max_steps")]:
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(TaskFileError, match=rf"games\.jsonl:2: .*{reason}"):
            HouseholdEnv.load_tasks(path)


def test_missing_textworld_is_one_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "textworld" else real(name, *a))
    with pytest.raises(MissingPackage, match=r"needs 'textworld': pip install 'omrl-search\[envs\]'"):
        HouseholdEnv.tasks("test")
    monkeypatch.setitem(sys.modules, "textworld", None)
    with pytest.raises(MissingPackage, match=r"pip install 'omrl-search\[envs\]'"):
        tw.RunningGame("whatever.z8")
