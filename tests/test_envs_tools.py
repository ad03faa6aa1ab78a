"""The tools env: the calculator, converter and lookups, the calendar and ledger, end-state
checks, the expert (reads first, then repairs the state) and generated and user tasks."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from envs import _toolkit as kit
from envs import tools
from envs._textactions import ActionError, SeededTasks
from envs.tools import ToolsEnv
from omrl_search.api import search_many
from omrl_search.env import TaskFileError, make_env

CAL = [["2025-04-17", "10:00", 60, "Standup"], ["2025-04-17", "14:00", 90, "Review"],
       ["2025-04-22", "09:00", 120, "Planning"]]
BOOK = {"add": [["2025-04-22", "14:00", 30, "Retro"]]}


def _env(goal=BOOK, plan=("lookup: holidays", "calendar: 2025-04-22")) -> ToolsEnv:
    env = make_env("tools")
    env.reset(ToolsEnv.task_from_dict({"instruction": "Do it.", "calendar": CAL, "goal": goal, "plan": list(plan)}))
    return env


@pytest.mark.parametrize("call,text", [
    (lambda: kit.calc("1.5 * 60"), "1.5 * 60 = 90"), (lambda: kit.calc("(2 + 3) / -4"), "(2 + 3) / -4 = -1.25"),
    (lambda: kit.calc("1 / 3"), "1 / 3 = 0.3333"), (lambda: kit.convert("1.5 hours to min")[0], "1.5 h = 90 min"),
    (lambda: kit.convert("100 C to F")[0], "100 C = 212 F"),
    (lambda: kit.convert("10 mi in km")[0], "10 mi = 16.0934 km"),
    (lambda: kit.convert("100 usd to EUR")[0], "100 USD = 92 EUR"),
    (lambda: kit.lookup("offices, mumbai")[0], "Mumbai: UTC+5.5, currency INR"),
    (lambda: kit.lookup("Prices, Desk Chair")[0], "desk chair: 189.5 GBP each"),
])
def test_toolkit(call, text):
    assert call() == text


@pytest.mark.parametrize("call,why", [
    (lambda: kit.calc("2 ** 3"), "numbers, \\+ - \\* / and parentheses only"),
    (lambda: kit.calc("__import__('os')"), "numbers, \\+ - \\* /"),
    (lambda: kit.calc("1 / (2 - 2)"), "division by zero"),
    (lambda: kit.convert("1 h to km"), "cannot convert h to km"),
    (lambda: kit.convert("ten h to min"), "write `convert"),
    (lambda: kit.convert("1 parsec to m"), "unknown unit 'parsec'"), (lambda: kit.lookup("pets"), "unknown table"),
    (lambda: kit.lookup("staff, Nobody"), "no row 'Nobody' in staff"),
])
def test_toolkit_refuses(call, why):
    with pytest.raises(ActionError, match=why):
        call()


def test_calendar_booking_and_cancelling():
    env = _env()
    assert env.step("calendar: 2025-04-17").observation.startswith(
        "Thursday 2025-04-17: E1 10:00-11:00 Standup; E2 14:00-15:30 Review\n")
    r = env.step("book: 2025-04-22, 10:30, 60, Retro")
    assert r.valid and r.info == {}
    assert r.observation.startswith("Not booked: 10:30-11:30 overlaps E3 09:00-11:00 Planning.")
    assert len(env.state.events) == 3
    assert env.step("book: 2025-04-22, 11:00, 60, Retro, part 2").observation.startswith(
        "Booked E4: 2025-04-22 11:00-12:00 Retro, part 2.")
    assert env.step("cancel: e2").valid and [e[0] for e in env.state.events] == ["E1", "E3", "E4"]
    assert env.step("expense: 12.5 eur, lunch").observation.startswith("Recorded X5: 12.5 EUR for lunch.")
    assert env.step("cancel: X5").valid and env.state.ledger == ()


@pytest.mark.parametrize("action,why", [
    ("book: 2025-04-22, 14:00, 1.5 h, Retro", "MINUTES must be a whole number"),
    ("book: 2025-02-30, 14:00, 30, Retro", "no such date"), ("book: 22/04/2025, 14:00, 30, Retro", "YYYY-MM-DD"),
    ("book: 2025-04-22, 25:00, 30, Retro", "HH:MM"), ("book: 2025-04-22, 23:30, 60, Late", "end by midnight"),
    ("book: 2025-04-22, 14:00", "expected 4 comma-separated arguments"), ("cancel: E9", "no event or expense"),
    ("expense: 12 euros, lunch", "currency code"), ("expense: -3 EUR, x", "must be positive"),
])
def test_bad_tool_calls_say_why(action, why):
    env = _env()
    r = env.step(action)
    assert r.valid is False and not r.done and why in r.observation
    assert env.state.events == env.state.spec.events


@pytest.mark.parametrize("actions,ok", [
    (["book: 2025-04-22, 14:00, 30, RETRO"], True),
    (["book: 2025-04-22, 14:30, 30, Retro"], False),
    (["book: 2025-04-22, 14:00, 30, Retro", "cancel: E1"], False),
])
def test_finish_checks_the_calendar(actions, ok):
    env = _env()
    for a in actions:
        env.step(a)
    r = env.step("finish")
    assert r.done and r.success is ok and r.reward == float(ok)
    assert r.info["answer"].startswith("+2025-04-22 14:")


@pytest.mark.parametrize("amount,ok", [("271.72", True), ("271.73", True), ("271.71", True),
                                       ("271.7", False), ("271.74", False)])
def test_finish_checks_expenses_to_the_cent(amount, ok):
    env = _env(goal={"expenses": [["271.72", "USD", "Monitor"]]}, plan=())
    env.step(f"expense: {amount} USD, monitor")
    assert env.step("finish").success is ok


def test_expert_reads_then_repairs_the_state():
    env = _env()
    env.step("calendar(2025-04-22)")  # a plan read the agent already made, written another way
    env.step("book: 2025-04-17, 16:00, 30, Retro")  # the wrong day
    actions = []
    while not env.state.done:
        actions.append(env.expert_action())
        result = env.step(actions[-1])
    assert actions == ["lookup: holidays", "cancel: E4", "book: 2025-04-22, 14:00, 30, Retro", "finish"]
    assert result.success and env.expert_action() is None


def test_generated_tasks(monkeypatch):
    test = ToolsEnv.tasks("test")
    assert len(test) == 50 and len({json.dumps(t.data) for t in test}) == 50
    kind = lambda goal: ("expense" if "expenses" in goal else "cleanup" if "remove" in goal  # noqa: E731
                         else "call" if goal["add"][0][3].startswith("Call with") else "meeting")
    kinds = [kind(t.data["goal"]) for t in test]
    assert {k: kinds.count(k) for k in set(kinds)} == {"meeting": 13, "call": 13, "expense": 12, "cleanup": 12}
    monkeypatch.setattr(tools, "_TASKS", SeededTasks("tools", tools._make_tasks, {"train": 500, "test": 50}))
    assert ToolsEnv.tasks("test") == test
    train = {json.dumps(t.data["calendar"]) for t in ToolsEnv.tasks("train")}
    assert train and not train & {json.dumps(t.data["calendar"]) for t in test}


def test_generated_meetings_need_the_holiday_table_and_several_days():
    for task in (t for t in ToolsEnv.tasks("test") if t.instruction.startswith("Book a")):
        plan = task.data["plan"]
        assert plan[:2] == ["lookup: holidays", plan[1]] and plan[1].startswith("convert: ")
        first = task.instruction.split("on or after ")[1].split()[1]
        booked = task.data["goal"]["add"][0][0]
        assert booked > first and plan[-1] == f"calendar: {booked}"


def test_oracle_solves_the_test_split():
    tasks = ToolsEnv.tasks("test")
    results = search_many(tasks, strategy="react", policy="scripted:oracle:p=0")
    assert [r.success for r in results] == [True] * len(tasks)


@pytest.mark.parametrize("row,why", [
    ({"calendar": CAL, "goal": BOOK}, "instruction must be a non-empty string"),
    ({"instruction": "x", "calendar": CAL, "goal": {}}, "goal must have add, remove and/or expenses"),
    ({"instruction": "x", "calendar": CAL, "goal": {"add": [["2025-04-17", "10:30", 30, "X"]]}},
     "goal add: Not booked: 10:30-11:00 overlaps E1"),
    ({"instruction": "x", "calendar": CAL, "goal": {"remove": ["E7"]}}, "goal remove: 'cancel: E7' fails"),
    ({"instruction": "x", "calendar": CAL, "goal": BOOK, "plan": ["cancel: E1"]},
     "plan: 'cancel: E1' fails: cancel is not allowed"),
    ({"instruction": "x", "calendar": [["2025-04-17", "10:00", 60]], "goal": BOOK}, "calendar rows are"),
    ({"instruction": "x", "calendar": CAL, "goal": {"expenses": [["ten", "EUR", "x"]]}}, "the amount must be a number"),
])
def test_bad_user_tasks(tmp_path, row, why):
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=rf"tools\.jsonl:1: .*{why}"):
        ToolsEnv.load_tasks(path)


def test_user_task_round_trip(tmp_path):
    path = tmp_path / "tools.jsonl"
    row = {"instruction": "Cancel the review and log lunch.", "calendar": CAL, "task_id": "mine",
           "goal": {"remove": ["E2"], "expenses": [[18, "EUR", "lunch"]]}}
    path.write_text(json.dumps(row) + "\n")
    (task,) = ToolsEnv.load_tasks(path)
    assert task.task_id == "mine" and task.instruction == row["instruction"]
    env = make_env("tools")
    env.reset(task)
    assert env.expert_action() == "cancel: E2"
    assert env.state.spec.goal_ledger == ((Fraction(18), "EUR", "lunch"),)
    assert search_many([task], policy="scripted:oracle:p=0")[0].success
