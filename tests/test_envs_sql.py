"""The sql env: generated databases and splits, result-equality and table-hash checks, the
statement guards, native snapshots, the expert (also off the reference path) and user tasks."""
from __future__ import annotations

import json

import pytest

from envs import _sqlite, sql
from envs._textactions import ActionError, SeededTasks, parse_action
from envs.sql import SqlEnv
from omrl_search.api import search_many
from omrl_search.env import TaskFileError, make_env, stable_hash

SETUP = [
    "CREATE TABLE dept (id INTEGER PRIMARY KEY, name TEXT)",
    "CREATE TABLE emp (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, salary INTEGER)",
    "INSERT INTO dept VALUES (1, 'Sales'), (2, 'Legal')",
    "INSERT INTO emp VALUES (1, 'Ada', 1, 5000), (2, 'Ben', 1, 6000), (3, 'Cy', 2, 7000), (4, 'Di', 2, 4000)",
]
SALES = "SELECT e.name FROM emp e JOIN dept d ON d.id = e.dept_id WHERE d.name = 'Sales'"
RAISE = "UPDATE emp SET salary = salary * 110 / 100 WHERE dept_id = 2"


def _env(**row) -> SqlEnv:
    env = make_env("sql")
    env.reset(SqlEnv.task_from_dict({"setup": SETUP, "question": "q?", **row}))
    return env


def test_action_syntax():
    verbs = SqlEnv.verbs
    assert parse_action("sql: SELECT count(*) FROM t", verbs) == ("sql", "SELECT count(*) FROM t")
    assert parse_action("`answer(Ada, Ben)`", verbs) == ("answer", "Ada, Ben")
    assert parse_action("Commit.", verbs) == ("commit", "")
    for bad, why in [("answer (", "cannot parse"), ("answer Ada", "cannot parse"), ("sql:", "needs an argument"),
                     ("commit: now", "takes no argument"), ("drop: t", "unknown action"), ("  ", "empty")]:
        with pytest.raises(ActionError, match=why):
            parse_action(bad, verbs)


def test_generated_tasks_deterministic_and_split_by_database(monkeypatch):
    test = SqlEnv.tasks("test")
    assert len(test) == 50 and len({t.task_id for t in test}) == 50
    kinds = {"writes" if "writes" in t.data else "query" for t in test}
    assert kinds == {"writes", "query"} and {t.data["domain"] for t in test} == {"company", "shop", "school"}
    assert any(t.data.get("ordered") for t in test) and any(len(t.data.get("writes", [])) == 2 for t in test)
    monkeypatch.setattr(sql, "_TASKS", SeededTasks("sql", sql._make_tasks, {"train": 500, "test": 50}))
    assert SqlEnv.tasks("test") == test
    train_dbs = {t.data["db_seed"] for t in SqlEnv.tasks("train")}
    assert train_dbs and not train_dbs & {t.data["db_seed"] for t in test}


def test_oracle_solves_the_test_split():
    tasks = SqlEnv.tasks("test")
    results = search_many(tasks, strategy="react", policy="scripted:oracle:p=0")
    assert [r.success for r in results] == [True] * len(tasks)


@pytest.mark.parametrize("answer,ok", [
    ("Ben, Ada", True), ("ada; BEN", True), ("'Ada', 'Ben'", True), (SALES, True),
    ("Ada", False), ("Ada, Ben, Cy", False), ("SELECT name FROM emp", False),
])
def test_read_answers_compared_as_sets(answer, ok):
    r = _env(query=SALES).step(f"answer: {answer}")
    assert r.done and r.valid and r.success is ok and r.reward == float(ok)


def test_ordered_and_multi_column_answers():
    top = "SELECT name FROM emp ORDER BY salary DESC LIMIT 2"
    assert _env(query=top, ordered=True).step("answer: Cy, Ben").success
    assert not _env(query=top, ordered=True).step("answer: Ben, Cy").success
    assert _env(query=top).step("answer: Ben, Cy").success  # not ordered: any order
    counts = "SELECT d.name, AVG(e.salary) FROM dept d JOIN emp e ON e.dept_id = d.id GROUP BY d.id"
    assert _env(query=counts).step("answer: Legal, 5500.0; Sales, 5500").success
    assert not _env(query=counts).step("answer: Legal, Sales, 5500, 5500").success


def test_writes_checked_by_the_written_tables():
    env = _env(writes=[RAISE])
    assert env.state.spec.affected == ("emp",)
    env.step("sql: UPDATE emp SET salary = ROUND(salary * 1.1) "
             "WHERE dept_id = (SELECT id FROM dept WHERE name = 'Legal')")
    r = env.step("commit")
    assert r.done and r.success and r.info["answer"] == stable_hash(env.state.spec.chain[-1])
    env = _env(writes=[RAISE])
    env.step("sql: UPDATE emp SET salary = salary + 700")
    assert not env.step("commit").success
    assert _env(query=SALES).step("commit").valid is False  # a question needs an answer
    r = _env(writes=[RAISE]).step("answer: 7700")
    assert r.valid is False and not r.done and "commit" in r.observation


def test_expert_repairs_a_wrong_write():
    env = _env(writes=[RAISE])
    env.step("sql: DELETE FROM emp WHERE id = 1")
    actions = []
    while not env.state.done:
        actions.append(env.expert_action())
        r = env.step(actions[-1])
    assert r.success
    assert actions[0] == "sql: DELETE FROM emp"
    assert actions[1].startswith("sql: INSERT INTO emp (id, name, dept_id, salary) VALUES (1, 'Ada', 1, 5000)")
    assert actions[2:] == ["commit"]
    env = _env(query=SALES)
    env.step("sql: DELETE FROM emp WHERE id = 2")  # the reference query would now miss Ben
    assert env.expert_action() == "answer: Ada, Ben"


@pytest.mark.parametrize("statement,why", [
    ("ATTACH 'x.db' AS x", "not authorized"), ("DROP TABLE emp", "not authorized"),
    ("PRAGMA writable_schema = 1", "not authorized"), ("SELECT random()", "function: random"),
    ("SELECT date('now')", "'now'"), ("SELECT 1; DELETE FROM emp", "one statement"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", "ran too long"),
    ("SELECT nme FROM emp", "no such column"), ("BEGIN", "no transaction control"),
    ("SAVEPOINT act", "no transaction control"), ("WITH x AS (SELECT 1) DROP TABLE emp", "syntax error"),
])
def test_statement_guards(statement, why):
    env = _env(query=SALES)
    key = env.state.db
    r = env.step(f"sql: {statement}")
    assert r.valid is False and not r.done and r.observation.startswith("Invalid action: SQL error")
    assert why in r.observation and env.state.db == key
    assert env.step("sql: PRAGMA table_info(emp)").valid


def test_huge_writes_are_rolled_back(monkeypatch):
    monkeypatch.setattr(_sqlite, "MAX_CHANGES", 3)
    env = _env(writes=[RAISE])
    r = env.step("sql: UPDATE emp SET salary = 0")
    assert r.valid is False and "changes more than 3 rows; nothing was changed" in r.observation
    assert env.conn.execute("SELECT SUM(salary) FROM emp").fetchone() == (22000,) and not env.conn.in_transaction
    assert env.step(f"sql: {RAISE}").valid and env.step("commit").success


def test_results_are_truncated_with_a_marker():
    env = make_env("sql")
    env.reset(next(t for t in SqlEnv.tasks("test") if t.data["domain"] == "company"))
    lines = env.step("sql: SELECT name, salary FROM employees").observation.splitlines()
    count = env.conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0]
    assert lines[0] == "name | salary" and len(lines) == 1 + 10 + 2
    assert lines[11] == f"... (only the first 10 of {count} rows are shown)"
    lines = env.step("sql: SELECT * FROM employees a, employees b, employees c").observation.splitlines()
    assert lines[11] == "... (only the first 10 of more than 1000 rows are shown)" and len(lines[1]) <= 200
    empty = env.step("sql: SELECT * FROM employees WHERE 0").observation
    assert empty.startswith("id | name | dept_id | salary | hired\n(no rows)")


def test_native_snapshots_share_the_image_of_read_only_branches():
    env = _env(writes=[RAISE])
    root = env.snapshot()
    assert root.kind == "native"
    env.step("sql: SELECT * FROM emp")
    read = env.snapshot()
    assert read.payload[0] is root.payload[0]  # reads copy nothing
    env.step(f"sql: {RAISE}")
    wrote = env.snapshot()
    assert wrote.payload[0] is not root.payload[0]
    env.restore(root)
    assert env.conn.execute("SELECT salary FROM emp WHERE id = 3").fetchone() == (7000,)
    fresh = make_env("sql")
    fresh.restore(wrote)
    assert fresh.conn.execute("SELECT salary FROM emp WHERE id = 3").fetchone() == (7700,)
    assert fresh.state_key() == wrote.state_key and fresh.step("commit").success


def test_answer_queries_cannot_write():
    env = _env(query=SALES)
    r = env.step("answer: WITH x AS (SELECT 1) DELETE FROM emp")
    assert r.valid is False and "must not change the database" in r.observation
    assert env.conn.execute("SELECT COUNT(*) FROM emp").fetchone() == (4,) and env.state.db == env.state.spec.db0


def test_same_database_by_two_routes_shares_the_database_digest():
    env = _env(writes=[RAISE])
    env.step("sql: UPDATE emp SET salary = 1 WHERE id = 1")
    env.step("sql: UPDATE emp SET salary = 5000 WHERE id = 1")
    assert env.state.db == env.state.spec.db0
    seen = {env.state.db}
    for _ in range(2):  # the same text again (served from the statement cache) is rehashed too
        env.step("sql: UPDATE emp SET salary = salary + 1 WHERE id = 1")
        seen.add(env.state.db)
    assert len(seen) == 3 and env.state.db[0] == env.state.spec.db0[0]  # dept untouched


@pytest.mark.parametrize("row,why", [
    ({"setup": SETUP, "query": SALES}, "question must be a non-empty string"),
    ({"setup": SETUP, "question": "q", "query": SALES, "writes": [RAISE]}, "exactly one of query"),
    ({"setup": SETUP, "question": "q", "query": "SELECT name FROM emp WHERE 0"}, "1 to 10 rows"),
    ({"setup": SETUP, "question": "q", "query": RAISE}, "reference fails: SQL error: this query must not change"),
    ({"setup": SETUP, "question": "q", "writes": ["DELETE FROM emp WHERE id = 99"]}, "write 1 must change"),
    ({"setup": SETUP, "question": "q", "query": "SELECT nme FROM emp"}, "reference fails: SQL error: no such column"),
    ({"setup": ["CREATE TABLE t (x"], "question": "q", "query": "SELECT 1"}, "setup statement 1 failed"),
    ({"domain": "zoo", "db_seed": 1, "question": "q", "query": "SELECT 1"}, "give either setup"),
    ({"setup": SETUP, "question": "q", "query": SALES, "ordered": "yes"}, "ordered must be true or false"),
])
def test_bad_user_tasks(tmp_path, row, why):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"setup": SETUP, "question": "q", "query": SALES}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=rf"tasks\.jsonl:2: .*{why}"):
        SqlEnv.load_tasks(path)


def test_user_tasks_on_a_generated_database(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"domain": "shop", "db_seed": 3, "question": "How many customers?",
             "query": "SELECT COUNT(*) FROM customers", "task_id": "mine"},
            {"setup": SETUP, "question": "Raise Legal by 10%.", "writes": [RAISE]}]
    path.write_text("\n".join(map(json.dumps, rows)))
    first, second = SqlEnv.load_tasks(path)
    assert first.task_id == "mine" and "the shop database" in first.instruction
    assert second.task_id.startswith("sql-") and "then finish with `commit`" in second.instruction
    results = search_many([first, second], policy="scripted:oracle:p=0")
    assert [r.success for r in results] == [True, True]
