"""Label files: parquet of per-step labels (the layout of ``omrl export prm`` / ``omrl label``) and
their validation.

One row per root-to-leaf path of a search tree:

========================  =========================================================================
``prompt``                the engine's system and first user turn (task, action help, example,
                          first observation) as ``[{role, content}]`` — exactly what the learned
                          PRM reads before the first step (older files: one user-turn string)
``completions``           each step's completion, thought + action
``labels``                ``soft_labels >= threshold`` per step (bools)
``soft_labels``           the training target per step, a float in [0, 1]
``mc_values``             Monte-Carlo value per step (share of successful rollouts), or null
``mc_rollouts``           rollouts behind each MC value
``q_values``              MCTS Q-value (value sum / visits) per step, or null without visits
``visits``                MCTS visit count per step
``observations``          the observation each step got back (rendered as the next user turn)
``segments``              exact token ids as the policy saw them: ``{role, token_ids, logprobs,
                          trainable}``
``env``, ``task_id``,     where the row comes from (``split`` is the task's split: train rows
``split``, ``strategy``   train, test rows only evaluate)
``success``, ``terminal``  whether the row's last step ended a solved episode / any episode
========================  =========================================================================

TRL 1.16 ships no PRM trainer (earlier releases' stepwise ``PRMTrainer``, last in
``trl.experimental.prm``, is gone; its layout put no observations between steps and no separator
between prompt and first step); ``omrl train prm`` reads these files (docs/interop.md).
:func:`read_labels` validates every row and fails with ``FILE:ROW: reason`` (rows count from 1).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable

REQUIRED = ("prompt", "completions", "labels", "soft_labels", "observations", "env", "task_id", "split")
OPTIONAL = ("mc_values", "mc_rollouts", "q_values", "visits", "segments", "strategy", "success",
            "terminal")


class LabelFileError(ValueError):
    """A label file is unreadable or a row is malformed; the message is ``FILE:ROW: reason``."""


def schema() -> Any:
    """The label files' pyarrow schema (``omrl export prm``'s)."""
    from omrl_search.exports import schema as export_schema

    return export_schema("prm")


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt else "prompt must not be empty"
    if not isinstance(prompt, list) or not prompt:
        return "prompt must be a non-empty list of {role, content} messages"
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "prompt must be a non-empty list of {role, content} messages"
    return None


def check_row(row: dict[str, Any]) -> str | None:
    """The first problem of one row, or None."""
    problem = _prompt_problem(row.get("prompt"))
    if problem:
        return problem
    for key in ("env", "task_id", "split"):
        if not isinstance(row.get(key), str) or not row[key]:
            return f"{key} must be a non-empty string"
    comps = row.get("completions")
    if not isinstance(comps, list) or not comps:
        return "no steps (completions is empty)"
    for i, c in enumerate(comps):
        if not isinstance(c, str) or not c.strip():
            return f"step {i + 1} is empty"
    n = len(comps)
    for key in ("labels", "soft_labels", "observations"):
        val = row.get(key)
        if not isinstance(val, list) or len(val) != n:
            got = len(val) if isinstance(val, list) else type(val).__name__
            return f"{key} has {got} entries for {n} steps"
    for i, y in enumerate(row["soft_labels"]):
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not math.isfinite(y) or not 0.0 <= y <= 1.0:
            return f"soft label {y!r} of step {i + 1} is outside [0, 1]"
    for i, y in enumerate(row["labels"]):
        if not isinstance(y, bool):
            return f"label {y!r} of step {i + 1} is not a bool"
    for key in ("mc_values", "q_values"):
        val = row.get(key)
        if val is None:
            continue
        if len(val) != n:
            return f"{key} has {len(val)} entries for {n} steps"
        for i, y in enumerate(val):
            if y is not None and not (isinstance(y, (int, float)) and 0.0 <= y <= 1.0):
                return f"{key[:-1].replace('_', ' ')} {y!r} of step {i + 1} is outside [0, 1]"
    return None


def read_labels(path: str | os.PathLike, splits: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Rows of one label file, validated (``FILE:ROW: reason`` on the first bad row)."""
    import pyarrow.parquet as pq

    path = str(path)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - one clear line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LabelFileError(f"{path}:0: cannot read parquet: {first}") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise LabelFileError(f"{path}:1: missing column(s) {', '.join(missing)}")
    if table.num_rows == 0:
        raise LabelFileError(f"{path}:0: no rows")
    rows = table.to_pylist()
    wanted = set(splits) if splits is not None else None
    out = []
    for i, row in enumerate(rows, 1):
        problem = check_row(row)
        if problem:
            raise LabelFileError(f"{path}:{i}: {problem}")
        if wanted is None or row["split"] in wanted:
            out.append(row)
    return out


def label_files(data: str | os.PathLike) -> list[Path]:
    """The parquet files of a label folder (or the one file given)."""
    p = Path(data)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise LabelFileError(f"{p}:0: no such file or folder")
    files = sorted(p.glob("*.parquet"))
    if not files:
        raise LabelFileError(f"{p}:0: no .parquet label files in the folder")
    return files


def load_label_dir(data: str | os.PathLike, splits: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Every validated row of a label folder (optionally only some splits)."""
    splits = list(splits) if splits is not None else None
    return [row for f in label_files(data) for row in read_labels(f, splits)]


def _stored(row: dict[str, Any], key: str) -> Any:
    """A row's value as the schema stores it: a string prompt is one user turn."""
    val = row.get(key)
    return [{"role": "user", "content": val}] if key == "prompt" and isinstance(val, str) else val


def write_labels(rows: list[dict[str, Any]], out: str | os.PathLike) -> dict[str, str]:
    """Write ``OUT/<split>.parquet`` per split (each validated first, written to a temporary
    name and renamed, so nothing half-written is left); returns split -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    for i, row in enumerate(rows, 1):
        problem = check_row(row)
        if problem:
            raise LabelFileError(f"<rows>:{i}: {problem}")
    by_split: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_split.setdefault(row["split"], []).append(row)
    from omrl_search.outdir import make_dirs, remove_dirs

    created = make_dirs(out)  # removed again if nothing could be written
    sch = schema()
    written, tmps, done = {}, [], False
    try:
        for split, part in sorted(by_split.items()):
            if not split.replace("-", "").replace("_", "").isalnum():
                raise LabelFileError(f"<rows>: split name {split!r} is not usable as a file name")
            table = pa.Table.from_pylist([{k: _stored(r, k) for k in sch.names} for r in part], schema=sch)
            tmp = out / f".{split}.parquet.tmp"
            tmps.append(tmp)
            pq.write_table(table, tmp)
            written[split] = str(out / f"{split}.parquet")
        for tmp in tmps:
            tmp.replace(out / tmp.name[1:-4])
        done = True
    finally:
        for tmp in tmps:
            if tmp.exists():
                tmp.unlink()
        if not done:
            remove_dirs(created)
    return written
