"""Curriculum knobs of game24, countdown and sokoban, and their splits.

Train and test never share a puzzle (compared by content: the numbers and target, the room),
for the built-in splits and for the streams the difficulty knobs draw; each knob does what it
says and is recorded in the task data; knobs given in the split string (what ``--split`` passes)
and as keywords give the same tasks; a bad knob is one error line; the built-in splits are the
ones they were (knobs only add streams) and the test splits hold at least 200 tasks.
"""
from __future__ import annotations

import pytest

from envs.countdown import CountdownEnv
from envs.game24 import Game24Env
from envs.sokoban import SokobanEnv, parse_room
from omrl_search.cli import main


def puzzle(task) -> tuple:
    """What makes a puzzle, whatever its id: the numbers and target, or the room."""
    if task.env == "sokoban":
        return parse_room(task.data["room"])
    return tuple(sorted(task.data["numbers"])), task.data["target"]


STREAMS = {  # knob strings to draw train and test streams with (sokoban: the fast ones)
    "game24": ["", "level=1", "level=3", "level=2-3"],
    "countdown": ["", "level=1", "level=3", "numbers=4,target=10-99", "numbers=3-4,target=10-20"],
    "sokoban": ["", "level=1", "boxes=1,size=5", "level=2,moves=4-6"],
}
CLASSES = {"game24": Game24Env, "countdown": CountdownEnv, "sokoban": SokobanEnv}


@pytest.mark.parametrize("name", list(STREAMS))
def test_train_and_test_share_no_puzzle(name):
    cls, seen = CLASSES[name], {"train": set(), "test": set()}
    for knobs in STREAMS[name]:
        for split in seen:
            tasks = cls.tasks(f"{split}:{knobs}" if knobs else split, limit=None if name != "sokoban" else 120)
            assert tasks and all(t.split == split for t in tasks)
            keys = [puzzle(t) for t in tasks]
            assert len(set(keys)) == len(keys), (name, split, knobs)  # no puzzle twice in a stream
            seen[split] |= set(keys)
    assert not seen["train"] & seen["test"]


def test_test_splits_have_200_tasks_or_more():
    assert len(CountdownEnv.tasks("test")) >= 200 and len(SokobanEnv.tasks("test")) >= 200
    assert len(Game24Env.tasks("test")) >= 250


def test_builtin_splits_unchanged_by_the_knobs():
    assert [t.task_id for t in CountdownEnv.tasks("test", limit=3)] == [
        "countdown-3-8-9-10-25-to-122", "countdown-14-21-100-to-394", "countdown-6-7-17-22-to-26"]
    rooms = [t.data["room"] for t in SokobanEnv.tasks("test", limit=101)]
    assert rooms[0] == ["#########", "#_______#", "#_#_#_#_#", "#______P#", "#_√#_X_##", "#____O__#",
                        "#_______#", "#_______#", "#########"]
    assert [t.task_id for t in SokobanEnv.tasks("test", limit=2)] == ["sokoban-test-0", "sokoban-test-1"]
    assert [t.task_id for t in Game24Env.tasks("test", limit=2)] == ["game24-1-4-12-12", "game24-1-2-12-12"]


def test_game24_levels_follow_the_solver():
    full = Game24Env.tasks("test")
    levels = {lv: Game24Env.tasks("test", level=lv) for lv in (1, 2, 3)}
    assert sorted(t.task_id for lv in levels for t in levels[lv]) == sorted(t.task_id for t in full)
    assert all(len(ts) >= 60 for ts in levels.values())  # about a third each
    for lv, ts in levels.items():
        assert all(t.data["level"] == lv for t in ts)
    good = {lv: [t.data["good_moves"] for t in ts] for lv, ts in levels.items()}
    assert min(good[1]) >= 8 and 4 <= min(good[2]) <= max(good[2]) <= 7 and max(good[3]) <= 3
    assert Game24Env.tasks("test:level=2-3") == [t for t in full if t.data["level"] >= 2]


def test_countdown_knobs():
    for knobs, count, target in [("numbers=4,target=10-99", (4, 4), (10, 99)), ("level=1", (3, 3), (10, 999)),
                                 ("level=3", (5, 6), (10, 999)), ("numbers=3-5,target=100-200", (3, 5), (100, 200))]:
        tasks = CountdownEnv.tasks(f"test:{knobs}")
        assert len(tasks) == 200, knobs
        assert all(count[0] <= len(t.data["numbers"]) <= count[1] for t in tasks), knobs
        assert all(target[0] <= t.data["target"] <= target[1] for t in tasks), knobs
        assert {t.data["level"] for t in tasks} <= {1 if c == 3 else 2 if c == 4 else 3
                                                    for c in range(count[0], count[1] + 1)}
    assert CountdownEnv.tasks("train", limit=5, numbers=4, target="10-99") == \
        CountdownEnv.tasks("train:target=10-99,numbers=4", limit=5)
    with pytest.raises(ValueError, match="leave no puzzle size"):
        CountdownEnv.tasks("test:level=1,numbers=5")


def test_sokoban_knobs():
    for knobs, size, boxes, moves in [("level=1", (5, 6), (1, 1), (3, 10)), ("level=2,moves=4-6", (6, 7), (2, 2), (4, 6)),
                                      ("boxes=1,size=5", (5, 5), (1, 1), (3, 12))]:
        tasks = SokobanEnv.tasks(f"test:{knobs}", limit=40)
        assert len(tasks) == 40
        for t in tasks:
            layout, _, bx = parse_room(t.data["room"])
            assert size[0] <= len(layout) - 2 <= size[1] and size[0] <= len(layout[0]) - 2 <= size[1]
            assert boxes[0] <= len(bx) == t.data["boxes"] <= boxes[1] and t.data["level"] == min(len(bx), 3)
            assert moves[0] <= t.data["optimal"] <= moves[1]
            assert t.data["size"] == [len(layout) - 2, len(layout[0]) - 2]
    assert SokobanEnv.tasks("test", limit=3, level=1) == SokobanEnv.tasks("test:level=1", limit=3)


@pytest.mark.parametrize("cls,split,needle", [
    (CountdownEnv, "test:digits=3", "countdown: unknown task knob 'digits' (known: level (1-3), numbers (3-6), target"),
    (CountdownEnv, "test:numbers=7", "countdown: task knob numbers must be an integer or a range LO-HI within 3-6, got '7'"),
    (SokobanEnv, "test:boxes", "sokoban: bad task knob 'boxes'"),
    (SokobanEnv, "dev:boxes=1", "sokoban has splits 'train' and 'test', not 'dev'"),
    (Game24Env, "test:level=0", "game24: task knob level must be"),
])
def test_bad_knobs_are_one_line(cls, split, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        cls.tasks(split)


def test_knobs_from_the_cli(tmp_path, capsys):
    rc = main(["search", "--env", "countdown", "--split", "test:numbers=3", "--limit", "3",
               "--policy", "scripted:oracle:p=0", "--out", str(tmp_path / "ok"), "--no-progress"])
    assert rc == 0 and "3/3" in capsys.readouterr().out
    rc = main(["search", "--env", "sokoban", "--split", "test:walls=3", "--out", str(tmp_path / "bad"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown task knob 'walls'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
