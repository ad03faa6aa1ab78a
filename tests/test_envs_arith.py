"""Game of 24 and Countdown: exact arithmetic, the answer checker, the solver and the task sets."""
from __future__ import annotations

import json
from fractions import Fraction
from itertools import combinations_with_replacement

import pytest

from envs import countdown, game24
from envs.arith import eval_expression, solvable, solve, to_text
from omrl_search.env import TaskFileError, make_env


def _env(numbers, name="game24", target=24):
    env = make_env(name)
    row = {"numbers": numbers} if name == "game24" else {"numbers": numbers, "target": target}
    env.reset(env.task_from_dict(row))
    return env


def test_exact_fraction_steps_3_3_8_8():
    env = _env([3, 3, 8, 8])
    r = env.step("8 / 3")
    assert r.valid and r.info == {} and "8 / 3 = 8/3" in r.observation
    assert env.state.numbers == (Fraction(8, 3), 3, 8)
    r = env.step("3 - 8/3")
    assert "Numbers left: 1/3 8 |" in r.observation
    r = env.step("8 ÷ 1/3.")
    assert (r.terminated, r.truncated, r.valid, r.success) == (True, False, True, True)
    assert r.reward == 1.0 and r.info == {"answer": "24"}


def test_solver_is_exact():
    assert to_text(solve((3, 3, 8, 8), 24)) == "8 / (3 - (8 / 3))"
    assert eval_expression(to_text(solve((1, 5, 5, 5), 24)))[0] == 24  # (5 - 1/5) * 5
    assert not solvable((1, 1, 1, 1), 24)
    assert solvable((2, 3, 5, 7, 11, 13), 30030) and not solvable((1, 3, 5, 7, 11, 13), 99991)
    assert _env([1, 1, 1, 1]).expert_action() is None


def test_expert_follows_fraction_solution():
    env = _env([3, 3, 8, 8])
    result = None
    while result is None or not result.done:
        result = env.step(env.expert_action())
    assert result.success


@pytest.mark.parametrize("text", ["4 * 6", "4*6", "  4 X 6. ", "`4 × 6`", "4 * 6 = 24", "4 x 6!"])
def test_forgiving_step_syntax(text):
    r = _env([1, 4, 6, 12]).step(text)
    assert r.valid, r.observation
    assert "Numbers left: 1 12 24 |" in r.observation


def test_step_rules():
    env = _env([4, 6, 6, 12])
    key = env.state_key()
    assert not env.step("4 * 4").valid  # only one 4
    assert env.state.numbers == (4, 6, 6, 12) and env.state.steps == 1 and env.state_key() != key
    assert not env.step("6 / 0").valid
    assert env.step("6 - 6").valid
    assert "division by zero" in env.step("12 / 0").observation
    assert env.state.numbers == (0, 4, 12)


def test_valid_actions_are_deduplicated_and_legal():
    env = _env([3, 3, 8, 8])
    actions = env.valid_actions()
    assert len(actions) == len(set(actions))
    assert "3 + 8" in actions and "8 + 3" not in actions  # commutative ops in one order
    assert "3 - 8" in actions and "8 - 3" in actions and "8 / 3" in actions and "3 / 8" in actions
    snap = env.snapshot()
    for action in actions:
        env.restore(snap)
        assert env.step(action).valid, action


@pytest.mark.parametrize(
    "expr,success,answer",
    [
        ("8 / (3 - 8 / 3)", True, "24"),
        ("8/(3-8/3) = 24.", True, "24"),
        ("8 * 3", False, "24"),  # does not use every number
        ("8 * 3 * 3 / 3", False, "24"),  # reuses 3, misses an 8
        ("8 + 8 + 3 + 3", False, "22"),  # wrong value
    ],
)
def test_answer_checker(expr, success, answer):
    r = _env([3, 3, 8, 8]).step(f"answer {expr}")
    assert r.done and r.valid and r.success is success and r.info["answer"] == answer
    assert r.reward == (1.0 if success else 0.0)


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "a + b", "2 ** 3", "3.0 * 8", "-3 + 27", "abs(3)", "(", "", "[8, 3]"],
)
def test_answer_rejects_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        eval_expression(expr)
    r = _env([3, 3, 8, 8]).step(f"answer {expr}")
    assert r.valid is False and not r.done


def test_game24_has_1362_solvable_puzzles():
    puzzles = game24.all_puzzles()
    assert len(list(combinations_with_replacement(range(1, 14), 4))) == 1820
    assert len(puzzles) == 1362  # the well-known count, checked by the exact solver
    train, test = game24.Game24Env.tasks("train"), game24.Game24Env.tasks("test")
    assert len(train) + len(test) == 1362
    assert {tuple(t.data["numbers"]) for t in train}.isdisjoint(tuple(t.data["numbers"]) for t in test)
    assert 0.15 < len(test) / 1362 < 0.25
    assert test[0].task_id == "game24-" + "-".join(map(str, test[0].data["numbers"]))


def test_countdown_tasks_are_valid_and_solvable():
    cls = countdown.CountdownEnv
    test, train = cls.tasks("test"), cls.tasks("train")
    assert (len(train), len(test)) == (1000, 200)
    for task in test + train[:100]:
        nums, target = task.data["numbers"], task.data["target"]
        assert 3 <= len(nums) <= 6 and all(x >= 1 for x in nums) and 10 <= target <= 999
        assert solvable(nums, target), task.task_id
    assert {len(t.data["numbers"]) for t in test} == {3, 4, 5, 6}
    env = make_env("countdown")
    env.reset(test[0])
    assert env.state.limit == 2 * len(test[0].data["numbers"]) <= env.max_steps


def test_countdown_must_use_every_number():
    env = _env([1, 2, 50], "countdown", target=52)
    r = env.step("answer 50 + 2")
    assert r.terminated and not r.truncated and not r.success
    env = _env([1, 2, 50], "countdown", target=52)
    env.step("50 + 2")
    r = env.step("52 * 1")
    assert r.done and r.success and r.info["answer"] == "52"


def test_jsonl_loading(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"numbers": [4, 6, 1, 1], "task_id": "mine"}\n\n{"numbers": [3, 3, 8, 8]}\n')
    tasks = game24.Game24Env.load_tasks(good)
    assert [t.task_id for t in tasks] == ["mine", "game24-3-3-8-8"]
    assert tasks[0].data == {"numbers": [1, 1, 4, 6], "target": 24, "good_moves": 16, "level": 1}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"numbers": [3, 3, 8, 8]}\n{"numbers": [3, 3, 8]}\n')
    with pytest.raises(TaskFileError, match=r"bad\.jsonl:2: numbers must be a list of 4 integers from 1 to 13, got \[3, 3, 8\]"):
        game24.Game24Env.load_tasks(bad)

    rows = ['{"numbers": [25, 4, 3], "target": 103}', '{"numbers": [25, 4, 3], "target": "103"}']
    cd = tmp_path / "cd.jsonl"
    cd.write_text("\n".join(rows))
    with pytest.raises(TaskFileError, match=r"cd\.jsonl:2: target must be an integer"):
        countdown.CountdownEnv.load_tasks(cd)
    cd.write_text(rows[0] + "\n" + json.dumps({"numbers": [1, 2]}))
    with pytest.raises(TaskFileError, match=r"cd\.jsonl:2: numbers must be a list of 3 to 6 integers"):
        countdown.CountdownEnv.load_tasks(cd)
