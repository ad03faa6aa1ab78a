"""Text-to-SQL over small generated SQLite databases: answer questions, or change the data.

Each seed makes one database (a company, a shop or a school, filled at random; see
:mod:`envs._sqldata`) and up to five tasks on it: *read* questions (joins, groups, orders,
limits), answered with ``answer: VALUES`` (or ``answer: SELECT ...``) and checked by result
equality, order-insensitive unless the question asks for an order; and *write* tasks (updates,
inserts, deletes), finished with ``commit`` and checked by a hash of the tables the reference
statements write. A stable hash of the seed picks the split, so train and test never share a
database.

Snapshots are native: the database's own image (``Connection.serialize``) plus the small
immutable episode state; a branch that only read shares its parent's image, and restoring it
into the connection that already holds it costs nothing. The agent's statements run on a guarded
connection (:mod:`envs._sqlite`).
"""
from __future__ import annotations

import json
import random
import re
import sqlite3
from functools import lru_cache
from typing import Any, NamedTuple

from omrl_search.env import NativeSnapshots, register_env, stable_hash
from omrl_search.types import Task

from ._sqldata import DOMAINS, build_db, fill_template
from ._sqlite import FETCH_CAP, Guarded, connect, run_sql, table_digests
from ._textactions import (ActionEnv, ActionError, Outcome, SeededTasks, norm_cell, split_values,
                           task_id_of, text_field)

SHOWN_ROWS = 10  # rows a query result shows (and the most a read question's answer may have)
LINE_CHARS = 200  # a result line is cut there
QUESTIONS_PER_DB = 5


def _show(v: Any) -> str:
    text = "NULL" if v is None else f"{v:.10g}" if isinstance(v, float) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def render_rows(cols: list[str], rows: list[tuple]) -> str:
    """A result as ``a | b`` lines, the first ``SHOWN_ROWS`` rows, with a marker for the rest."""
    lines = [" | ".join(cols)[:LINE_CHARS]] + [" | ".join(map(_show, r))[:LINE_CHARS] for r in rows[:SHOWN_ROWS]]
    if len(rows) > SHOWN_ROWS:
        total = f"more than {FETCH_CAP}" if len(rows) > FETCH_CAP else str(len(rows))
        lines.append(f"... (only the first {SHOWN_ROWS} of {total} rows are shown)")
    else:
        lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})" if rows else "(no rows)")
    return "\n".join(lines)


def rows_key(rows: list[list[str]], ordered: bool) -> str:
    """Normalised result rows as compared with the reference (sorted unless ``ordered``)."""
    return stable_hash(rows if ordered else sorted(rows))


def _literal(v: Any) -> str:
    """A stored value as an SQL literal (for the expert's repair INSERT)."""
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    return "NULL" if v is None else f"X'{v.hex()}'" if isinstance(v, bytes) else repr(v)


class SqlSpec(NamedTuple):
    """A task, prepared once per process: the initial image, the reference and its results."""

    key: str
    initial: bytes
    kind: str  # "read" or "write"
    sql: tuple[str, ...]  # the reference query, or the reference writes in order
    ordered: bool
    tables: tuple[str, ...]
    schema: str  # the tables as the observation lists them
    db0: tuple[str, ...]  # digests of the tables at the start
    width: int = 0  # read: columns of the reference result
    gold: str = ""  # read: rows_key of the reference result
    gold_text: str = ""  # read: the answer as the expert writes it
    affected: tuple[str, ...] = ()  # write: tables the reference writes
    chain: tuple[tuple[str, ...], ...] = ()  # write: digests of the written tables after 0, 1, ...
    # reference statements
    final: tuple[tuple[str, tuple[str, ...], tuple[tuple, ...], str], ...] = ()  # write: per
    # written table, its columns, expected rows and their digest


class SqlState(NamedTuple):
    spec: SqlSpec
    db: tuple[str, ...]  # digests of the tables (the database part of the state key)
    shown: str  # rows_key of the last query's result ("" after a write)
    steps: int = 0
    limit: int = 10
    done: bool = False
    truncated: bool = False  # ended by the step limit
    success: bool = False
    answer: str = ""
    note: str = ""


def _setup_db(statements: Any) -> bytes:
    if not (isinstance(statements, list) and 0 < len(statements) <= 2000
            and all(isinstance(s, str) for s in statements)):
        raise ValueError("setup must be a list of SQL statements (strings)")
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_DENY if action in (
        sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_PRAGMA) else sqlite3.SQLITE_OK)
    for i, stmt in enumerate(statements, 1):
        try:
            conn.execute(stmt)
        except (sqlite3.Error, sqlite3.Warning) as exc:
            raise ValueError(f"setup statement {i} failed: {exc}") from None
    conn.set_authorizer(None)  # serializing a plain :memory: database reads its pages by SQL
    return conn.serialize()


def _schema(conn: Guarded, tables: tuple[str, ...]) -> str:
    """One line per table: ``name(column TYPE, ...) -- N rows``."""
    lines = []
    for t in tables:
        cols = ", ".join(f"{c[1]} {c[2]}".strip() for c in conn.execute(f"PRAGMA table_info('{t}')"))
        count = conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0]
        lines.append(f"{t}({cols}) -- {count} rows")
    return "\n".join(lines)


def spec_of(data: dict[str, Any]) -> SqlSpec:
    """The prepared task of ``data``; raise ``ValueError(reason)`` when it is unusable."""
    return _spec(json.dumps(data, sort_keys=True))


@lru_cache(maxsize=4096)
def _spec(data_json: str) -> SqlSpec:
    data = json.loads(data_json)
    if "setup" in data:
        initial = _setup_db(data["setup"])
    elif data.get("domain") in DOMAINS and type(data.get("db_seed")) is int and data["db_seed"] >= 0:
        initial = build_db(data["domain"], data["db_seed"])
    else:
        raise ValueError(f"give either setup (SQL statements) or domain ({', '.join(DOMAINS)}) "
                         "and db_seed (an integer >= 0)")
    conn = connect()
    conn.load(initial)
    tables = tuple(r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"))
    if not tables:
        raise ValueError("the database has no tables")
    base = dict(key=stable_hash(data_json), initial=initial, ordered=bool(data.get("ordered", False)),
                tables=tables, schema=_schema(conn, tables), db0=table_digests(conn, tables))
    try:
        if "query" in data:
            return _read_spec(conn, data["query"], base)
        if "writes" in data:
            return _write_spec(conn, data["writes"], base)
    except ActionError as exc:
        raise ValueError(f"the reference fails: {exc}") from None
    finally:
        conn.close()
    raise ValueError("give query (a SELECT) or writes (a list of INSERT/UPDATE/DELETE statements)")


def _read_spec(conn: Guarded, query: Any, base: dict[str, Any]) -> SqlSpec:
    if not isinstance(query, str):
        raise ValueError(f"query must be a string, got {query!r}")
    cols, rows, _ = run_sql(conn, query, read_only=True)
    if cols is None:
        raise ValueError("query must be a SELECT")
    if not 1 <= len(rows) <= SHOWN_ROWS or all(v is None for r in rows for v in r):
        raise ValueError(f"the reference result must have 1 to {SHOWN_ROWS} rows and a value, "
                         f"got {len(rows)} rows")
    shown = [[_show(v) for v in r] for r in rows]
    if any(re.search(r"[,;|\n]", v) for r in shown for v in r):
        raise ValueError("reference values must not contain , ; | or new lines")
    text = ", ".join(r[0] for r in shown) if len(cols) == 1 else "; ".join(", ".join(r) for r in shown)
    norm = [[norm_cell(v) for v in r] for r in rows]
    return SqlSpec(kind="read", sql=(query,), width=len(cols), gold=rows_key(norm, base["ordered"]),
                   gold_text=text, **base)


def _write_spec(conn: Guarded, writes: Any, base: dict[str, Any]) -> SqlSpec:
    if not (isinstance(writes, list) and 1 <= len(writes) <= 5 and all(isinstance(w, str) for w in writes)):
        raise ValueError("writes must be a list of 1 to 5 SQL statements")
    written: set[str] = set()
    for i, stmt in enumerate(writes, 1):
        cols, _, changed = run_sql(conn, stmt)
        if cols is not None or not changed:
            raise ValueError(f"write {i} must change at least one row (and return none)")
        written |= conn.written
    affected = tuple(sorted(written))
    conn.load(base["initial"])
    chain = [table_digests(conn, affected)]
    for stmt in writes:
        run_sql(conn, stmt)
        chain.append(table_digests(conn, affected))
    if len(set(chain)) != len(chain):
        raise ValueError("every write must change the tables it writes to a new state")
    final = tuple((t, tuple(d[0] for d in conn.execute(f'SELECT * FROM "{t}"').description),
                   tuple(conn.execute(f'SELECT * FROM "{t}"')), digest)
                  for t, digest in zip(affected, chain[-1]))
    return SqlSpec(kind="write", sql=tuple(writes), affected=affected, chain=tuple(chain),
                   final=final, **base)


@register_env("sql")
class SqlEnv(NativeSnapshots, ActionEnv):
    """Answer a question about, or make a change to, a small SQLite database."""

    description = "Text-to-SQL: query a small SQLite database to answer a question or change its data."
    action_help = (
        "Actions: `sql: STATEMENT` runs one SQLite statement (SELECT, INSERT, UPDATE or DELETE) "
        f"and shows its result (the first {SHOWN_ROWS} rows); `schema` lists the tables; "
        "`answer: VALUES` answers a question (values separated by commas, rows by semicolons, "
        "e.g. `answer: Sales, 4; Legal, 2`), or `answer: SELECT ...` answers with a query's "
        "result; `commit` finishes a task that changes the database."
    )
    examples = (
        "Think: I need the employees of the Sales department, so I join employees and departments.\n"
        "Act: sql: SELECT e.name FROM employees e JOIN departments d ON d.id = e.dept_id "
        "WHERE d.name = 'Sales'"
    )
    verbs = {"sql": "sql: STATEMENT", "schema": "schema", "answer": "answer: VALUES", "commit": "commit"}
    max_steps = 10

    def __init__(self) -> None:
        self.state: SqlState | None = None
        self.conn = connect()
        self._image: bytes | None = None  # the image the connection holds (None after a write)

    def reset(self, task: Task) -> str:
        spec = spec_of(task.data)
        self.conn.load(spec.initial)
        self._image = spec.initial
        self.state = SqlState(spec, spec.db0, "", limit=self.max_steps,
                              note=f"Database tables:\n{spec.schema}")
        return self.observe()

    def close(self) -> None:
        self.conn.close()

    # --- snapshots: the database image and the episode state ----------------------------
    def save_native(self) -> tuple[bytes, SqlState]:
        s = self._require()
        if self._image is None:
            self._image = self.conn.serialize()
        return self._image, s

    def load_native(self, payload: tuple[bytes, SqlState]) -> None:
        image, state = payload
        if image is not self._image or self.state is None:
            self.conn.load(image)
            self._image = image
        self.state = state

    # --- actions --------------------------------------------------------------------------
    def do_sql(self, statement: str) -> Outcome:
        cols, rows, changed = run_sql(self.conn, statement)
        changes: dict[str, Any] = {"shown": ""}
        if changed:  # rehash the tables written
            self._image, tables, db = None, self.state.spec.tables, list(self.state.db)
            dirty = [i for i, t in enumerate(tables) if t in self.conn.written] or range(len(tables))
            for i, digest in zip(dirty, table_digests(self.conn, tuple(tables[i] for i in dirty))):
                db[i] = digest
            changes["db"] = tuple(db)
        if cols is None:
            return Outcome(f"OK: {changed} row{'' if changed == 1 else 's'} changed.", changes=changes)
        if not changed:
            changes["shown"] = rows_key([[norm_cell(v) for v in r] for r in rows], self.state.spec.ordered)
        return Outcome(render_rows(cols, rows), changes=changes)

    def do_schema(self, _: str) -> Outcome:
        return Outcome(f"Database tables:\n{self.state.spec.schema}")

    def do_answer(self, text: str) -> Outcome:
        spec = self.state.spec
        if spec.kind == "write":
            raise ActionError("this task changes the database: make the changes with `sql: ...`, then `commit`")
        if re.match(r"(?is)(select|with)\b", text):
            cols, rows, _ = run_sql(self.conn, text, read_only=True)
            got = [[norm_cell(v) for v in r] for r in rows]
        else:
            got = split_values(text)
            if spec.width == 1:
                got = [[c] for r in got for c in r]
        ok = all(len(r) == spec.width for r in got) and rows_key(got, spec.ordered) == spec.gold
        answer = "; ".join(", ".join(r) for r in (got if spec.ordered else sorted(got)))
        verdict = "Correct." if ok else "Wrong: that is not the answer."
        return Outcome(f"Answered: {answer[:200]}. {verdict}", final=(ok, answer))

    def do_commit(self, _: str) -> Outcome:
        spec = self.state.spec
        if spec.kind == "read":
            raise ActionError("this task asks a question: reply with `answer: VALUES`")
        written = self._written_digests()
        ok = written == spec.chain[-1]
        verdict = "the changes are right" if ok else "the tables are not in the expected state"
        return Outcome(f"Committed: {verdict}.", final=(ok, stable_hash(written)))

    def _written_digests(self) -> tuple[str, ...]:
        """The digests of the tables the reference writes, in the current state."""
        s = self.state
        return tuple(s.db[s.spec.tables.index(t)] for t in s.spec.affected)

    reasons = {
        "schema": ("I look at the tables first.", "First I see which tables there are."),
        "answer": ("The query result gives the answer: {arg}.", "The rows I saw answer the question: {arg}."),
        "commit": ("The tables now hold the requested change, so I commit.", "The change is made; I commit it."),
    }
    _QUERY = ("This query computes what the question asks; I run it to see the result.",
              "I query the tables the question is about to get its answer.",
              "Running this query shows the rows the answer comes from.")
    _WRITE = ("This statement makes the change the task asks for.",
              "The task asks for a change to the data, and this statement makes it.",
              "I change the tables as the task says with this statement.")

    def reasons_for(self, verb: str, arg: str) -> tuple[str, ...]:
        if verb != "sql":
            return super().reasons_for(verb, arg)
        return self._QUERY if re.match(r"(?is)\s*(select|with)\b", arg) else self._WRITE

    def verbs_now(self) -> dict[str, str]:
        """A question is answered, a change committed: the other verb only gets refused."""
        skip = "commit" if self._require().spec.kind == "read" else "answer"
        return {v: usage for v, usage in self.verbs.items() if v != skip}

    # --- expert and exploration ---------------------------------------------------------
    def expert_action(self) -> str | None:
        """Reads: run the reference query, then answer with its result (straight away when the
        database has been changed). Writes: the next reference statement while the written
        tables are on the reference path; off it, rewrite a wrong table (delete, re-insert);
        then ``commit``."""
        s = self._require()
        spec = s.spec
        if s.done:
            return None
        if spec.kind == "read":
            if s.shown != spec.gold and s.db == spec.db0:
                return f"sql: {spec.sql[0]}"
            return f"answer: {spec.gold_text}"
        written = self._written_digests()
        if written == spec.chain[-1]:
            return "commit"
        if written in spec.chain:
            return f"sql: {spec.sql[spec.chain.index(written)]}"
        for (table, cols, rows, want), have in zip(spec.final, written):
            if have != want:
                if self.conn.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone():
                    return f"sql: DELETE FROM {table}"
                values = ", ".join(f"({', '.join(map(_literal, r))})" for r in rows)
                return f"sql: INSERT INTO {table} ({', '.join(cols)}) VALUES {values}"
        return "commit"  # pragma: no cover - the digest matched no state yet every table does

    def valid_actions(self) -> list[str]:
        """A few exploratory reads (the action space itself is open: any SQL), and ``commit``
        for a write task."""
        s = self._require()
        if s.done:
            return []
        done = ["commit"] if s.spec.kind == "write" else []
        return ["schema"] + [f"sql: SELECT * FROM {t} LIMIT 5" for t in s.spec.tables] + done

    # --- task sets ------------------------------------------------------------------------
    @staticmethod
    def make_task(data: dict[str, Any], split: str, task_id: str) -> Task:
        spec = spec_of(data)
        where = f"the {data['domain']} database" if "domain" in data else "this database"
        if spec.kind == "read":
            how = ("Run queries with `sql: SELECT ...`, then reply `answer: VALUES` (values "
                   "separated by commas, rows by semicolons) or `answer: SELECT ...`.")
            what = "Answer this question about"
        else:
            how = "Make the change with `sql: ...` statements, then finish with `commit`."
            what = "Make this change to"
        return Task(env="sql", task_id=task_id, split=split, seed=0,
                    instruction=f"{what} {where} (SQLite): {data['question']} {how}", data=data)

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        return _TASKS.take(split, limit)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        data: dict[str, Any] = {"question": text_field(row, "question")}
        for key in ("setup", "domain", "db_seed", "query", "writes", "ordered"):
            if key in row:
                data[key] = row[key]
        if ("query" in data) == ("writes" in data):
            raise ValueError("give exactly one of query (a SELECT) or writes (a list of statements)")
        if not isinstance(data.get("ordered", False), bool):
            raise ValueError(f"ordered must be true or false, got {data['ordered']!r}")
        spec = spec_of(data)
        return cls.make_task(data, row.get("split", "test"), task_id_of(row, f"sql-{spec.key}"))


def _make_tasks(seed: int, split: str) -> list[Task]:
    """Up to ``QUESTIONS_PER_DB`` tasks on the database of ``seed`` (rejected drafts redrawn)."""
    domain = sorted(DOMAINS)[seed % len(DOMAINS)]
    dom, rng = DOMAINS[domain], random.Random(f"sql:{seed}")
    conn = connect()
    conn.load(build_db(domain, seed))
    tasks = []
    for j, template in enumerate(rng.sample(dom.templates, QUESTIONS_PER_DB)):
        for _ in range(6):
            question, sql = fill_template(conn, dom, template, rng)
            data: dict[str, Any] = {"domain": domain, "db_seed": seed, "question": question}
            if len(sql) == 1 and sql[0].startswith("SELECT"):
                data.update(query=sql[0], ordered=template.ordered)
            else:
                data["writes"] = list(sql)
            try:
                tasks.append(SqlEnv.make_task(data, split, f"sql-{seed}-{j}"))
                break
            except ValueError:
                continue
    conn.close()
    return tasks


_TASKS = SeededTasks("sql", _make_tasks, {"train": 500, "test": 50})
