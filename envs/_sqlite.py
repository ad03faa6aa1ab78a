"""A guarded SQLite connection for statements written by an agent (used by the ``sql`` env).

Statements run in autocommit mode under an authorizer (SELECT, INSERT, UPDATE, DELETE and a few
read-only pragmas; nothing that attaches files, changes the schema, controls transactions or
depends on the clock, the RNG or the connection's history) and a progress handler that stops
runaway queries; a write is refused and rolled back when it changes too many rows. The tables a
statement writes are reported, so the env rehashes only those.
"""
from __future__ import annotations

import re
import sqlite3
from typing import Any

from omrl_search.env import stable_hash

from ._textactions import ActionError

FETCH_CAP = 1000  # rows fetched at most from one query
VM_STEPS = 1_000_000  # SQLite VM instructions one statement may run (references need < 2,000)
MAX_CHANGES = 20_000  # rows one statement may change (keeps images and hashing small)
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE,
            sqlite3.SQLITE_DELETE, sqlite3.SQLITE_RECURSIVE}
_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}
_NO_FUNCTIONS = {"random", "randomblob", "changes", "total_changes", "last_insert_rowid",
                 "load_extension"}
_DML = re.compile(r"\b(insert|update|delete|replace)\b", re.IGNORECASE)
_TRANSACTION = re.compile(r"\s*(savepoint|release|rollback|begin|commit|end)\b", re.IGNORECASE)
_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "foreign_key_list"}  # read-only


class Guarded(sqlite3.Connection):
    """A connection that counts the progress-handler calls of the running statement and runs
    the env's own statements (loading an image, hashing, savepoints) past its guards."""

    ticks = 0
    trusted = False  # the env's own statement: neither authorized nor stopped
    read_only = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: set[str] = set()  # tables the last statement wrote
        self.writes_of: dict[str, frozenset[str]] = {}  # statement -> tables (the authorizer
        # sees a statement only when it is prepared, not when the statement cache serves it)

    def own(self, statement: str) -> list[tuple]:
        """Run one of the env's own statements."""
        self.trusted = True
        try:
            return self.execute(statement).fetchall()
        finally:
            self.trusted = False

    def load(self, image: bytes) -> None:
        """Replace the database by ``image`` (``sqlite3_deserialize`` runs an ATTACH of its own)."""
        self.trusted = True
        try:
            self.deserialize(image)
        finally:
            self.trusted = False


def connect() -> Guarded:
    """An in-memory connection in autocommit mode under the env's authorizer and step limit."""
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False, factory=Guarded)

    def authorize(action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
        if conn.trusted:
            return sqlite3.SQLITE_OK
        if action in _WRITES and conn.read_only:
            return sqlite3.SQLITE_DENY
        if action in _WRITES and not arg1.startswith("sqlite_"):
            conn.written.add(arg1)
        if action == sqlite3.SQLITE_FUNCTION:
            return sqlite3.SQLITE_DENY if arg2.lower() in _NO_FUNCTIONS else sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            return sqlite3.SQLITE_OK if arg1.lower() in _PRAGMAS else sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY

    def progress() -> bool:
        conn.ticks += 1
        return not conn.trusted and conn.ticks > VM_STEPS // 1000

    conn.set_authorizer(authorize)
    conn.set_progress_handler(progress, 1000)
    return conn


def run_sql(conn: Guarded, statement: str, read_only: bool = False) -> tuple[list[str] | None, list[tuple], int]:
    """``(columns or None for a write, rows, rows changed)``, and the tables written in
    ``conn.written``; raise ``ActionError`` with SQLite's reason when the statement fails or is
    refused (writes too, when ``read_only``; a write of more than ``MAX_CHANGES`` rows is
    rolled back)."""
    if re.search(r"'now'", statement, re.IGNORECASE):
        raise ActionError("SQL error: the current date and time ('now') are not available")
    if _TRANSACTION.match(statement):  # (refused here too: the env's own SAVEPOINT is cached)
        raise ActionError("SQL error: no transaction control; every statement commits by itself")
    # Only a statement naming a write can write: the others skip the savepoint and run
    # read-only, so a write this test missed is refused rather than unguarded. (The mode
    # follows from the text alone, so statements served from the cache keep it.)
    writes = _DML.search(statement) is not None
    if writes and read_only:
        raise ActionError("SQL error: this query must not change the database")
    conn.ticks, conn.read_only, cur = 0, not writes, None
    conn.written.clear()
    before = conn.total_changes
    if writes:
        conn.own("SAVEPOINT act")
    try:
        cur = conn.execute(statement)
        cols = [d[0] for d in cur.description] if cur.description else None
        rows = cur.fetchmany(FETCH_CAP + 1) if cols else []
        cur.close()
        if conn.total_changes - before > MAX_CHANGES:
            conn.own("ROLLBACK TO act")
            raise ActionError(f"the statement changes more than {MAX_CHANGES} rows; nothing was changed")
    except (sqlite3.Error, sqlite3.Warning) as exc:
        msg = str(exc).rstrip(".")
        if msg == "interrupted":
            msg = "the statement ran too long and was stopped"
        elif msg == "not authorized":
            msg += " (only SELECT, INSERT, UPDATE and DELETE are allowed)"
        raise ActionError(f"SQL error: {msg}") from None
    finally:
        conn.read_only = False
        if cur is not None:
            cur.close()
        if writes and conn.in_transaction:  # (an error that rolled everything back has ended it)
            conn.own("RELEASE act")
    if writes:
        conn.written |= conn.writes_of.setdefault(statement, frozenset(conn.written))
    return cols, rows, conn.total_changes - before


def table_digests(conn: Guarded, tables: tuple[str, ...]) -> tuple[str, ...]:
    """Per table, a hash of its rows in any order (hidden rowids aside): the write tasks'
    check, and the database part of the state key."""
    out = []
    for t in tables:
        rows = conn.own(f'SELECT * FROM "{t}"')
        try:
            rows.sort()
        except TypeError:  # NULLs or mixed types in a column
            rows.sort(key=repr)
        out.append(stable_hash((t, rows)))
    return tuple(out)
