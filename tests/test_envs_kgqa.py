"""The kgqa env: generated graphs and splits, the tool actions, exact-match answers, the expert
(reusing what the agent found) and user tasks over given triples."""
from __future__ import annotations

import json

import pytest

from envs import kgqa
from envs._textactions import SeededTasks
from envs.kgqa import INVERSE, KgqaEnv, make_graph
from omrl_search.api import search_many
from omrl_search.env import TaskFileError, make_env

TRIPLES = [
    ["Ann", "born_in", "Oslo"], ["Bob", "born_in", "Oslo"], ["Cat", "born_in", "Rome"],
    ["Ann", "works_for", "Acme"], ["Bob", "works_for", "Zeta"], ["Cat", "works_for", "Acme"],
    ["Oslo", "located_in", "Norway"], ["Rome", "located_in", "Italy"], ["Dan", "founded", "Acme"],
]
COUNT = ["neighbors: Oslo, birthplace_of", "neighbors: Acme, employs", "intersect: #1, #2", "count: #3", "answer: #4"]


def _env(program=COUNT, **row) -> KgqaEnv:
    env = make_env("kgqa")
    env.reset(KgqaEnv.task_from_dict({"triples": TRIPLES, "question": "q?", "program": program, **row}))
    return env


def test_generated_graphs_and_splits(monkeypatch):
    g = make_graph(7)
    assert {k for *_, k in g.edges(keys=True)} == set(INVERSE)
    assert {t for _, t in g.nodes(data="type")} == {"person", "city", "country", "company", "university", "film"}
    assert sorted(g.edges(keys=True)) == sorted(make_graph(7).edges(keys=True))
    test = KgqaEnv.tasks("test")
    assert len(test) == 50 and len({json.dumps(t.data) for t in test}) == 50
    assert {len(t.data["program"]) for t in test} >= {3, 4, 5, 7}  # two to six hops before answering
    monkeypatch.setattr(kgqa, "_TASKS", SeededTasks("kgqa", kgqa._make_tasks, {"train": 500, "test": 50}))
    assert KgqaEnv.tasks("test") == test
    train_graphs = {t.data["graph_seed"] for t in KgqaEnv.tasks("train")}
    assert train_graphs and not train_graphs & {t.data["graph_seed"] for t in test}


def test_oracle_solves_the_test_split():
    tasks = KgqaEnv.tasks("test")
    results = search_many(tasks, strategy="react", policy="scripted:oracle:p=0")
    assert [r.success for r in results] == [True] * len(tasks)


def test_tool_actions():
    env = _env()
    assert env.step("relations: acme").observation.startswith("Relations of Acme: employs (2), founded_by (1)\n")
    r = env.step("neighbors(Oslo, birthplace_of)")
    assert r.valid and r.info == {} and r.observation.startswith("#1 = {Ann, Bob} (2 entities)")
    assert env.step("neighbors: #1, works_for").observation.startswith("#2 = {Acme, Zeta} (2 entities)")
    assert env.step("relations: #1").observation.startswith("Relations of #1: born_in (2), works_for (2)")
    assert env.step("neighbors: Ann, founded").observation.startswith("#3 = {} (0 entities)")
    assert env.step("count: #2").observation.startswith("#4 = 2  [count of #2]")
    assert env.state.vars == (("Ann", "Bob"), ("Acme", "Zeta"), (), 2)


@pytest.mark.parametrize("action,why", [
    ("neighbors: Oslp, birthplace_of", "no entity named 'Oslp' (did you mean Oslo?)"),
    ("neighbors: Oslo, lives_in", "unknown relation 'lives_in'"),
    ("neighbors: Oslo", "expected an entity and a relation"),
    ("intersect: #1, #9", "'#9' is not a result (results: #1 to #1)"),
    ("count: #1, #1", "'#1, #1' is not a result"),
    ("answer Ann", "cannot parse"),
])
def test_bad_actions_say_why(action, why):
    env = _env()
    env.step("neighbors: Oslo, birthplace_of")
    r = env.step(action)
    assert r.valid is False and not r.done and why in r.observation
    assert env.state.vars == (("Ann", "Bob"),)


def test_count_results_are_numbers():
    env = _env()
    env.step("neighbors: Oslo, birthplace_of")
    env.step("count: #1")
    r = env.step("neighbors: #2, works_for")
    assert r.valid is False and "#2 is a number, not a set of entities" in r.observation


@pytest.mark.parametrize("program,answer,ok", [
    (COUNT, "answer: #4", True), (COUNT, "answer: 1", True), (COUNT, "answer: #1", False),
    (COUNT[:3] + ["answer: #3"], "answer: ann", True), (COUNT[:3] + ["answer: #3"], "answer: Ann, Cat", False),
    (["neighbors: Oslo, birthplace_of", "answer: #1"], "answer: Bob, 'ann'", True),
])
def test_exact_match_answers(program, answer, ok):
    env = _env(program)
    for step in program[:-1]:
        env.step(step)
    r = env.step(answer)
    assert r.done and r.valid and r.success is ok and r.reward == float(ok)


def test_expert_maps_the_program_onto_the_agents_results():
    env = _env()
    env.step("relations: Acme")
    env.step("neighbors: Acme, employs")  # the program's #2, found first as #1
    assert env.expert_action() == "neighbors: Oslo, birthplace_of"
    env.step(env.expert_action())
    assert env.expert_action() == "intersect: #2, #1"
    env.step(env.expert_action())
    assert [env.expert_action(), env.step(env.expert_action()).valid] == ["count: #3", True]
    assert env.expert_action() == "answer: #4"
    assert env.step("answer: #4").success


def test_expert_does_not_skip_a_step_whose_result_looks_done():
    # Cat is the only Acme employee born in Rome, so the intersection equals result #2
    env = _env(["neighbors: Acme, employs", "neighbors: Rome, birthplace_of", "intersect: #1, #2", "answer: #3"])
    env.step("neighbors: Acme, employs")
    env.step("neighbors: Rome, birthplace_of")
    assert env.expert_action() == "intersect: #1, #2"
    env.step("intersect: #1, #2")
    assert env.expert_action() == "answer: #3"


def test_user_tasks(tmp_path):
    path = tmp_path / "kg.jsonl"
    rows = [{"triples": TRIPLES, "question": "Who founded Acme?", "answer": ["Dan"], "task_id": "mine"},
            {"triples": TRIPLES, "question": "How many?", "program": COUNT, "answer": [1]},
            {"graph_seed": 3, "question": "Which films?",
             "program": ["neighbors: The Missing Reel, cast", "answer: #1"]}]
    path.write_text("\n".join(map(json.dumps, rows)))
    with pytest.raises(TaskFileError, match=r"kg\.jsonl:3: program step 1 .* no entity named 'The Missing Reel'"):
        KgqaEnv.load_tasks(path)
    path.write_text("\n".join(map(json.dumps, rows[:2])))
    tasks = KgqaEnv.load_tasks(path)
    assert tasks[0].task_id == "mine" and tasks[1].task_id.startswith("kgqa-")
    env = make_env("kgqa")
    env.reset(tasks[0])
    assert env.expert_action() == "answer: Dan"
    assert [r.success for r in search_many(tasks, policy="scripted:oracle:p=0")] == [True, True]


@pytest.mark.parametrize("row,why", [
    ({"triples": TRIPLES, "question": "q", "program": COUNT[:2]}, "must end with its only `answer"),
    ({"triples": TRIPLES, "question": "q", "program": COUNT, "answer": [2]},
     r"answer \[2\] is not what the program gives \(1\)"),
    ({"triples": [["Ann", "born in"]], "question": "q", "answer": ["x"]}, "each triple must be"),
    ({"triples": [["A, B", "born_in", "Oslo"]], "question": "q", "answer": ["x"]}, "cannot contain"),
    ({"triples": TRIPLES, "question": "q"}, "give program"),
    ({"question": "q", "answer": ["x"]}, "give triples"),
    ({"triples": TRIPLES, "question": "q", "program": ["neighbors: Ann, founded", "answer: #1"]}, "1 to 8 entities"),
])
def test_bad_user_tasks(tmp_path, row, why):
    path = tmp_path / "kg.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=rf"kg\.jsonl:1: .*{why}"):
        KgqaEnv.load_tasks(path)
