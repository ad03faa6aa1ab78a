"""Sokoban: deterministic generation, BFS solutions, disjoint splits, push mechanics, text format."""
from __future__ import annotations

import json
import random

import pytest

from envs import sokoban
from envs.sokoban import SokobanEnv, parse_room, render, solve
from omrl_search.env import TaskFileError, make_env
from omrl_search.types import Task


def _env(rows: list[str]) -> SokobanEnv:
    env = make_env("sokoban")
    env.reset(Task(env="sokoban", task_id="t", data={"room": rows, "optimal": 3}))
    return env


def test_generation_is_deterministic(monkeypatch):
    first = SokobanEnv.tasks("test", limit=15)
    monkeypatch.setattr(sokoban, "_ROOMS", {})
    monkeypatch.setattr(sokoban, "_CURSOR", {})
    assert SokobanEnv.tasks("test", limit=15) == first
    rng = lambda: random.Random("sokoban:train:7")  # noqa: E731
    assert sokoban._generate(rng(), "train") == sokoban._generate(rng(), "train")


def test_generated_rooms_are_bfs_solvable():
    for task in SokobanEnv.tasks("test", limit=30):
        layout, player, boxes = parse_room(task.data["room"])
        path = solve(layout, player, boxes)
        assert path is not None and len(path) == task.data["optimal"]
        assert sokoban.MOVES_RANGE[0] <= len(path) <= sokoban.MOVES_RANGE[1]
        assert 6 <= len(layout) - 2 <= 7 and 1 <= len(boxes) <= 2
        env = make_env("sokoban")
        env.reset(task)
        for move in path:
            result = env.step(move)
        assert result.done and result.success
        assert env.state.limit == min(max(4 * len(path), 12), env.max_steps)


def test_splits_are_disjoint():
    train, test = SokobanEnv.tasks("train"), SokobanEnv.tasks("test")
    assert (len(train), len(test)) == (500, 200)
    rooms = {s: [tuple(t.data["room"]) for t in ts] for s, ts in (("train", train), ("test", test))}
    assert len(set(rooms["train"])) == 500 and len(set(rooms["test"])) == 200
    assert not set(rooms["train"]) & set(rooms["test"])
    for split, rows in rooms.items():
        assert all(sokoban.room_split(*parse_room(list(r))) == split for r in rows)


ROOM = [
    "#######",
    "#PX_XO#",
    "#____O#",
    "#######",
]


def test_push_mechanics():
    env = _env(ROOM)
    r = env.step("left")
    assert r.valid and r.info == {} and "nothing happened" in r.observation
    assert env.state.player == (1, 1) and env.state.steps == 1
    r = env.step("Move Right.")
    assert "pushed a box right" in r.observation
    assert env.state.player == (1, 2) and env.state.boxes == ((1, 3), (1, 4))
    key = env.state_key()
    r = env.step("right")  # a box behind the box: blocked, but the move still counts
    assert "blocked" in r.observation and env.state.boxes == ((1, 3), (1, 4)) and env.state.steps == 3
    assert env.state_key() != key
    env.step("down")
    env.step("right")
    env.step("right")
    r = env.step("up")  # pushes the box at (1, 4) up into the wall: blocked
    assert "blocked" in r.observation and env.state.player == (2, 4)
    r = env.step("right")  # onto a target
    assert r.observation.splitlines()[1:4] == ["#######", "#__XXO#", "#____S#"]
    assert "Boxes on targets: 0 of 2. Possible moves: up, left." in r.observation


def test_solving_ends_the_episode():
    env = _env(["#####", "#PXO#", "#####"])
    r = env.step("right")
    assert (r.terminated, r.truncated, r.valid, r.success) == (True, False, True, True)
    assert r.reward == 1.0 and r.info == {"answer": "solved"}
    assert env.observe().splitlines()[1:4] == ["#####", "#_P√#", "#####"]


def test_deadlock_makes_expert_give_up():
    env = _env(["######", "#____#", "#_X__#", "#_P_O#", "######"])
    assert env.expert_action() is not None
    env.step("up")  # the box now sits against the top wall, away from the target's row
    assert env.state.boxes == ((1, 2),)
    assert env.expert_action() is None
    assert env.valid_actions()  # still free to walk around


def test_render_parse_round_trip():
    for task in SokobanEnv.tasks("test", limit=10):
        env = make_env("sokoban")
        env.reset(task)
        grid = render(env.state).split("\n")
        assert grid == task.data["room"]
        assert parse_room(grid) == (env.state.layout, env.state.player, env.state.boxes)
        assert all(line in env.observe() for line in grid) and "Legend:" in env.observe()
    # the XSB level format is accepted too
    assert parse_room(["#####", "#@$.#", "#####"]) == parse_room(["#####", "#PXO#", "#####"])
    layout, player, boxes = parse_room(["######", "#+*$ #", "######"])
    assert render(sokoban.SokobanState(layout, player, boxes)) == "######\n#S√X_#\n######"


@pytest.mark.parametrize(
    "rows,reason",
    [
        (["#######", "#_PX#O#", "#_____#", "#######"], "room is not solvable"),
        (["#####", "#_XO#", "#####"], "exactly one player"),
        (["#####", "#PX_O", "#####"], "not enclosed"),
        (["#####", "#PX?O#", "#####"], "unknown symbol"),
        (["#####", "#PXX_O#", "#####"], "as many boxes as targets"),
        ("#PXO#", "non-empty list of strings"),
    ],
)
def test_jsonl_bad_rows(tmp_path, rows, reason):
    path = tmp_path / "rooms.jsonl"
    path.write_text(json.dumps({"room": ["#####", "#PXO#", "#####"]}) + "\n" + json.dumps({"room": rows}) + "\n")
    with pytest.raises(TaskFileError, match=rf"rooms\.jsonl:2: .*{reason}"):
        SokobanEnv.load_tasks(path)


def test_jsonl_good_rows(tmp_path):
    path = tmp_path / "rooms.jsonl"
    path.write_text('{"room": ["######", "#P_X_O#", "#######"], "task_id": "corridor"}\n')
    (task,) = SokobanEnv.load_tasks(path)
    assert task.task_id == "corridor" and task.data["optimal"] == 3
    assert task.data["room"] == ["#######", "#P_X_O#", "#######"]  # padded with walls
