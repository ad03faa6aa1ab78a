"""BabyAI (minigrid): splits, the egocentric text view against the true grid, planned actions,
invalid actions, copy-on-write snapshots, the bot advising after detours, the oracle."""
from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest

from envs import _babyai_text as text
from envs import babyai
from envs._optional import MissingPackage
from envs.babyai import BabyAIEnv
from omrl_search.api import search_many
from omrl_search.env import TaskFileError, make_env

TEST = BabyAIEnv.tasks("test")


def _env(task) -> BabyAIEnv:
    env = make_env("babyai")
    env.reset(task)
    return env


def _cell_of(env, thing):
    """The absolute grid cell of a thing seen ``ahead`` steps forward and ``right`` to the right."""
    m = env._sim[0]
    return tuple(np.array(m.agent_pos) + thing.ahead * m.dir_vec + thing.right * m.right_vec)


def test_splits_are_disjoint_and_use_missions():
    train = BabyAIEnv.tasks("train")
    assert (len(train), len(TEST)) == (300, 60)
    assert not {t.seed for t in train} & {t.seed for t in TEST}
    assert [t.data["level"] for t in TEST[:6]] == list(babyai.LEVELS)
    assert len({t.seed for t in TEST}) == 60  # one seed per task, across levels too
    for task in TEST[:6]:
        assert task.instruction == babyai._make(task.data["level"], task.seed).mission
    assert TEST[2].instruction.startswith("pick up") and TEST[3].instruction.startswith("open")


def test_text_view_matches_the_grid():
    rng = random.Random(0)
    for task in TEST[:12]:
        env = _env(task)
        for _ in range(6):
            view = env.state.view
            m = env._sim[0]
            for thing in view.things:  # every thing named where it really is
                obj = m.grid.get(*_cell_of(env, thing))
                assert (obj.type, obj.color) == (thing.kind, thing.color), thing
                assert f"{thing.name} (" in env.observe()
            names = [t.name for t in view.things]
            assert len(names) == len(set(names))
            if m.carrying:
                assert f"You are carrying a {m.carrying.color} {m.carrying.type}." in env.observe()
            if env.step(rng.choice(["turn left", "turn right", "move forward"])).done:
                break


def test_planned_actions_do_what_they_say():
    checked = set()
    maze = BabyAIEnv.task_from_dict({"level": "BabyAI-GoToObjMazeOpen-v0", "seed": 0})  # open doors
    for task in TEST[:18] + [maze]:
        env = _env(task)
        snap = env.snapshot()
        for action in env.valid_actions():
            verb = next((v for v in text.MACROS if action.startswith(v + " ")), None)
            if verb is None:
                continue
            thing = next(t for t in env.state.view.things if action == f"{verb} {t.name}")
            cell = _cell_of(env, thing)
            env.restore(snap)
            result = env.step(action)
            assert result.valid is True, action
            m = env._sim[0]
            if verb == "go to" and not result.done:
                assert tuple(m.front_pos) == cell
            elif verb == "pick up" and not result.done:
                assert (m.carrying.type, m.carrying.color) == (thing.kind, thing.color)
            elif "go through" in verb and not result.done:  # just past the door, facing away
                assert m.grid.get(*cell).is_open and tuple(np.array(m.agent_pos) - m.dir_vec) == cell
            checked.add(verb)
            env.restore(snap)
    assert checked == set(text.MACROS)


def test_invalid_and_primitive_actions():
    env = _env(TEST[1])
    key, expert = env.state_key(), env.expert_action()
    for action, why in [("go to purple unicorn 1", "there is no purple unicorn 1 in view"),
                        ("dance", "cannot parse 'dance'"), ("", "empty action")]:
        result = env.step(action)
        assert result.valid is False and not result.done and result.reward == 0.0
        assert result.observation.startswith(f"Invalid action: {why}. Actions:")
        assert "Available actions:" in result.observation
    assert env.expert_action() == expert and env.state_key() != key and env.state.steps == 3
    m = env._sim[0]
    while m.grid.get(*m.front_pos) is None or m.grid.get(*m.front_pos).type != "wall":
        env.step("move forward")
        m = env._sim[0]
    pos = tuple(m.agent_pos)
    result = env.step("Move Forward.")  # into the wall: a legal move that changes nothing
    assert result.valid is True and result.observation.startswith("You cannot move forward.")
    assert tuple(env._sim[0].agent_pos) == pos


def test_hands_full_and_locked_doors_are_explained():
    env = _env(TEST[1])  # GoToLocal: many objects in one room
    first, second = (t.name for t in env.state.view.things[:2])
    assert env.step(f"pick up {first}").valid
    result = env.step(f"pick up {second}")
    assert result.valid is False and "your hands are full" in result.observation

    env = _env(TEST[4])  # UnlockLocal: a key and a locked door
    key = next(t for t in env.state.view.things if t.kind == "key")
    for _ in range(4):
        door = next((t for t in env.state.view.things if t.kind == "door"), None)
        if door:
            break
        env.step("turn left")
    assert door is not None and door.state == "locked"
    result = env.step(f"toggle and go through {door.name}")
    assert result.valid is False
    assert f"the {door.name} is locked: carry the {door.color} key" in result.observation
    assert key.color == door.color
    result = env.step(f"go through {door.name}")
    assert result.valid is False
    assert f"the {door.name} is locked: toggle and go through it" in result.observation


def test_snapshots_are_copy_on_write():
    env = _env(TEST[5])
    snap = env.snapshot()
    sim = snap.payload[0]
    start = (tuple(sim[0].agent_pos), sim[0].agent_dir)
    assert env._sim is sim  # shared until the next step
    env.step(env.expert_action())
    env.step("move forward")
    assert env._sim is not sim and (tuple(sim[0].agent_pos), sim[0].agent_dir) == start
    walls = lambda m: [o for o in m.grid.grid if o is not None and o.type == "wall"]  # noqa: E731
    assert all(a is b for a, b in zip(walls(sim[0]), walls(env._sim[0]), strict=True))
    assert env._sim[0]._np_random is not sim[0]._np_random and env._sim[1].mission is env._sim[0]
    fresh = make_env("babyai")
    fresh.restore(snap)
    assert (fresh.observe(), fresh.state_key()) == (snap.observation, snap.state_key)


def test_expert_advises_after_detours():
    rng = random.Random(1)
    for task in TEST[:12]:
        env = _env(task)
        for _ in range(4):
            if env.step(rng.choice(["turn left", "turn right", "move forward"])).done:
                break
        result = None
        while not env.state.done:
            result = env.step(env.expert_action())
            assert result.valid
        assert result is None or result.success, task.task_id


def test_bot_is_rebuilt_when_a_box_is_opened(monkeypatch):
    from minigrid.utils import baby_ai_bot

    errors = []
    replan = baby_ai_bot.BabyAIBot.replan

    def counting(self, action=None):
        try:
            return replan(self, action)
        except baby_ai_bot.DisappearedBoxError as exc:
            errors.append(exc)
            raise

    monkeypatch.setattr(baby_ai_bot.BabyAIBot, "replan", counting)
    env = _env(TEST[1])  # "go to a yellow box"; opening the purple box makes it vanish
    assert TEST[1].instruction == "go to a yellow box"
    env.step("go to purple box 1")
    assert env.step("toggle").observation.startswith("You open the purple box.")
    assert len(errors) == 1 and env.expert_action() is not None
    while not env.state.done:
        result = env.step(env.expert_action())
    assert result.success


def test_oracle_solves_test_tasks_in_process():
    results = search_many(TEST[:6], strategy="react", policy="scripted:oracle:p=0")
    assert all(r.success for r in results) and not any(r.faults for r in results)
    results = search_many(TEST[:3], strategy="beam", policy="scripted:oracle:p=0.3", seed=2)
    assert all(r.success for r in results) and not any(r.faults for r in results)


def test_task_rows(tmp_path):
    path = tmp_path / "levels.jsonl"
    path.write_text(json.dumps({"level": "BabyAI-GoToObj-v0", "seed": 3, "task_id": "mine"}) + "\n")
    (task,) = BabyAIEnv.load_tasks(path)
    assert task.task_id == "mine" and task.instruction.startswith("go to")
    assert task.data["max_steps"] == BabyAIEnv.max_steps
    for bad, reason in [({"level": "GoToLocal", "seed": 1}, "level must be a BabyAI level id"),
                        ({"level": "BabyAI-Nope-v0", "seed": 1}, "unknown BabyAI level"),
                        ({"level": "BabyAI-GoToLocal-v0", "seed": "1"}, "seed must be"),
                        ({"level": "BabyAI-GoToLocal-v0", "seed": 1, "split": "dev"}, "split must be")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(TaskFileError, match=rf"levels\.jsonl:1: {reason}"):
            BabyAIEnv.load_tasks(path)


def test_missing_minigrid_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "minigrid", None)
    with pytest.raises(MissingPackage, match=r"needs 'minigrid': pip install 'omrl-search\[envs\]'"):
        babyai._make("BabyAI-GoToLocal-v0", 0)
