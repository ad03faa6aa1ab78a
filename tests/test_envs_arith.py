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


# --- exact rationals through the solver, the expert and its thoughts ----------------------------
@pytest.mark.parametrize("numbers", [[1, 5, 5, 5], [3, 3, 8, 8], [1, 3, 4, 6]])
def test_expert_solves_fraction_puzzles_step_by_step(numbers):
    """Every solution of these needs a fraction on the way; the expert writes it as ``a/b``."""
    env = _env(numbers)
    moves, result = [], None
    while (action := env.expert_action()) is not None:
        assert env.explain(action) is not None
        moves.append(action)
        result = env.step(action)
        assert result.valid, (action, result.observation)
    assert result.success and any("/" in fmt_ for m in moves for fmt_ in m.split(" ")[::2])


def test_fractions_are_written_and_read_exactly():
    env = _env([1, 5, 5, 5])
    assert "1 / 5 = 1/5" in env.step("1 / 5").observation
    assert "5 - 1/5 = 24/5" in env.step("5 - 1/5").observation
    assert env.state.numbers == (Fraction(24, 5), 5)
    assert not env.step("24/5 / 0").valid and not env.step("24/0 * 5").valid
    r = env.step("24/5 * 5")
    assert r.success and r.info == {"answer": "24"}


# --- the answer step (task knob answer=on) -----------------------------------------------------
def _answer_env(numbers, name="game24", target=24):
    env = make_env(name)
    row = {"numbers": numbers, "answer_step": True}
    if name == "countdown":
        row["target"] = target
    env.reset(env.task_from_dict(row))
    return env


def test_answer_step_waits_for_the_whole_expression():
    env = _answer_env([4, 4, 6, 8])
    assert env.state.limit == 7 and env.state.answer_step
    for action in ("4 + 8", "6 - 4", "12 * 2"):
        r = env.step(action)
    assert not r.done and r.valid and not r.success and r.reward == 0.0
    assert "Only 24 is left" in r.observation and "Numbers left: 24 |" in r.observation
    assert env.valid_actions() == ["answer (6 - 4) * (4 + 8)"] == [env.expert_action()]
    assert not env.step("24 * 1").valid  # nothing left to combine
    r = env.step("answer (4 + 8) * (6 - 4)")
    assert r.terminated and r.success and r.reward == 1.0 and r.info == {"answer": "24"}
    assert "(4 + 8) * (6 - 4) = 24" in r.observation


@pytest.mark.parametrize("expr,why", [("(4 + 8) * 2", "must use exactly 4 4 6 8"),
                                      ("4 * 8 - 6 - 4", "22 is not 24")])
def test_answer_step_checks_numbers_and_value(expr, why):
    env = _answer_env([4, 4, 6, 8])
    for action in ("4 + 8", "6 - 4", "12 * 2"):
        env.step(action)
    r = env.step(f"answer {expr}")
    assert r.terminated and not r.success and r.valid and why in r.observation


def test_answer_step_with_fractions_and_a_direct_answer():
    env = _answer_env([1, 5, 5, 5])
    while not env.state.done:
        r = env.step(env.expert_action())
    assert r.success and env.state.steps == 4
    assert env.state.path == ("1 / 5", "5 - 1/5", "24/5 * 5")
    env = _answer_env([1, 5, 5, 5])
    r = env.step("answer (5 - 1 / 5) * 5")  # ToT's last step straight from the start
    assert r.terminated and r.success


def test_answer_step_missed_target_still_ends():
    env = _answer_env([4, 4, 6, 8])
    for action in ("4 + 8", "6 - 4"):
        env.step(action)
    r = env.step("12 + 2")
    assert r.terminated and not r.success and r.info == {"answer": "14"}


def test_answer_step_off_is_todays_episode():
    env = _env([4, 4, 6, 8])
    for action in ("4 + 8", "6 - 4"):
        env.step(action)
    r = env.step("12 * 2")
    assert r.terminated and r.success and env.state.limit == 6


def test_answer_step_countdown_and_step_limit():
    env = _answer_env([1, 2, 50], "countdown", target=52)
    assert env.state.limit == 7
    env.step("50 + 2")
    r = env.step("52 * 1")
    assert not r.done and env.expert_action() == "answer 1 * (2 + 50)"
    for _ in range(5):  # 2 combines + 5 refused steps = the limit, 2 * 3 + 1
        r = env.step("hello")
    assert r.truncated and not r.success and "Out of steps (7)" in r.observation


@pytest.mark.parametrize("cls,split", [(game24.Game24Env, "test:answer=on"),
                                       (game24.Game24Env, "test:level=2,answer=on"),
                                       (countdown.CountdownEnv, "test:numbers=4,answer=on")])
def test_answer_knob_in_the_split(cls, split):
    tasks = cls.tasks(split, limit=3)
    plain = cls.tasks(split.replace(",answer=on", "").replace(":answer=on", ""), limit=3)
    assert cls.tasks(split)[:3] == tasks
    assert [t.task_id for t in tasks] == [t.task_id for t in plain]
    assert all(t.data["answer_step"] is True and "answer EXPR" in t.instruction for t in tasks)
    assert all("answer_step" not in t.data and "answer EXPR" not in t.instruction for t in plain)
    assert all(t.split == "test" for t in tasks)
    base = split.replace(",answer=on", "").replace(":answer=on", "")
    assert cls.tasks(base, limit=2, answer="on") == tasks[:2]
    assert cls.tasks(split, limit=2, answer=False) == plain[:2]  # the keyword wins
    assert cls.tasks(split.replace("=on", "=off"), limit=2) == plain[:2]


def test_answer_knob_errors():
    with pytest.raises(ValueError, match=r"^game24: task knob answer must be on or off, got 'yes'$"):
        game24.Game24Env.tasks("test:answer=yes")
    with pytest.raises(ValueError, match=r"unknown task knob 'size' \(known: level \(1-3\), answer \(on\|off\)\)"):
        game24.Game24Env.tasks("test:size=2")
    with pytest.raises(ValueError, match=r"answer_step must be true or false, got 'on'"):
        game24.Game24Env.task_from_dict({"numbers": [1, 2, 3, 4], "answer_step": "on"})


def test_answer_step_search_with_the_oracle():
    import omrl_search as om

    tasks = om.load_tasks("game24", "test:answer=on", limit=4)
    for r in om.search_many(tasks, strategy="react", policy="scripted:oracle:p=0"):
        actions = [s.action for s in r.best_trajectory.steps]
        assert r.success and len(actions) == 4 and actions[-1].startswith("answer ")


# --- state keys: history-distinct states stay apart; dedup_key merges them ----------------------
def test_state_keys_keep_histories_apart():
    a, b = _env([4, 4, 6, 8]), _env([4, 4, 6, 8])
    a.step("4 + 8"), a.step("6 - 4")
    b.step("6 - 4"), b.step("4 + 8")
    assert a.state.numbers == b.state.numbers == (2, 12)
    assert a.state_key() != b.state_key() and a.dedup_key() == b.dedup_key()
    c = _env([4, 4, 6, 8])
    c.step("8 + 4")
    assert c.state_key() != a.state_key() and "8 + 4 = 12" in c.observe()
    c.step("6 - 4")
    assert c.state_key() == a.state_key()  # the same operations (8 + 4 is 4 + 8): the same state
    snap = a.snapshot()
    b.restore(snap)
    assert b.state_key() == snap.state_key == a.state_key()
