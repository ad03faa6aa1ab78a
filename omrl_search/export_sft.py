"""SFT rows: rejection sampling from search trees (``sft``, ``rs-sft``) and the OpenManus-RL import.

* :func:`sft_rows` (``sft``): per search result, up to ``top_k`` distinct finished trajectories,
  successful ones first, fewer steps first.
* :func:`rs_sft_rows` (``rs-sft``, rejection-sampling / expert-iteration SFT): per *task*,
  across every result given (several rounds or strategies), only successful trajectories,
  deduplicated by their **action sequence** (two paths that take the same actions with other
  thoughts are one), at most ``cap`` per task, fewer steps first.

Invalid steps on a kept path carry no loss (``trainable: false`` on the segment and on the
assistant message). Columns: see :mod:`omrl_search.exports`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from .agent import TurnEncoder
from .export_common import ExportError, Renderer, env_reward, outcome, segments_from_messages
from .result import SearchResult
from .textfile import read_utf8
from .tree import Node, SearchTree, dedup_key


def _row(r: Renderer, tree: SearchTree, path: list[Node], mask_invalid: bool) -> dict[str, Any]:
    leaf = path[-1]
    return {"task_id": tree.task.task_id, "env": tree.task.env,
            "messages": r.messages(tree, path, r.flags(path, 1, mask_invalid)),
            "segments": r.segments(tree, path, 1, mask_invalid),
            "success": bool(leaf.success), "reward": env_reward(path), "steps": len(path) - 1}


def _distinct(paths: Iterable[tuple[SearchTree, list[Node]]], by: str, limit: int
              ) -> Iterator[tuple[SearchTree, list[Node]]]:
    """The first ``limit`` (at least one) of ``paths`` that differ in their steps' ``by`` field
    (``completion`` or ``action``) or, with ``by="state"``, in the states they pass through (the
    nodes' dedup keys: two orders of the same moves, or two spellings of one action, reach the
    same states and are one path), in order; ``paths`` is consumed lazily."""
    seen: set[tuple[str, ...]] = set()
    for tree, path in paths:
        key = tuple(dedup_key(n) if by == "state" else getattr(n.step, by) for n in path[1:])
        if key in seen:
            continue
        seen.add(key)
        yield tree, path
        if len(seen) >= limit:
            return


def sft_rows(results: Iterable[SearchResult], *, top_k: int = 1, include_failures: bool = False,
             tokenizer: TurnEncoder | None = None, mask_invalid: bool = True) -> list[dict[str, Any]]:
    """Rejection sampling: per result, up to ``top_k`` distinct finished trajectories, successful
    ones (``include_failures``: failed ones too, after them), fewer steps first."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ExportError(f"sft: top_k must be an integer >= 1, got {top_k!r}")
    r = Renderer(tokenizer)
    rows = []
    for res in results:
        tree = res.tree
        leaves = [n for n in tree.terminals() if n.parent is not None and (n.success or include_failures)]
        leaves.sort(key=lambda n: (-outcome(n), n.depth, n.id))
        paths = ((tree, tree.path(leaf)) for leaf in leaves)
        rows += [_row(r, t, p, mask_invalid) for t, p in _distinct(paths, "completion", top_k)]
    return rows


def rs_sft_rows(results: Iterable[SearchResult], *, cap: int = 4, tokenizer: TurnEncoder | None = None,
                mask_invalid: bool = True, dedup: str = "state") -> list[dict[str, Any]]:
    """Rejection-sampling SFT: the successful trajectories of every task over all ``results``
    (e.g. several rounds' trees), deduplicated by the states they pass through (``dedup="state"``,
    the default) or by action sequence (``"action"``), at most ``cap`` per task (fewer steps
    first, then in the order the results and their trees hold them). Rows are grouped by task
    in first-seen order."""
    if cap < 1:
        raise ExportError(f"rs-sft: cap must be >= 1, got {cap}")
    if dedup not in ("state", "action"):
        raise ExportError(f"rs-sft: dedup must be state or action, got {dedup!r}")
    r = Renderer(tokenizer)
    per_task: dict[tuple[str, str], list[tuple[int, int, int, SearchTree, list[Node]]]] = {}
    for i, res in enumerate(results):
        tree = res.tree
        key = (tree.task.env, tree.task.task_id)
        for leaf in tree.terminals():
            if leaf.parent is not None and leaf.success:
                per_task.setdefault(key, []).append((leaf.depth, i, leaf.id, tree, tree.path(leaf)))
    rows = []
    for found in per_task.values():
        found.sort(key=lambda f: f[:3])
        paths = ((tree, path) for *_, tree, path in found)
        rows += [_row(r, t, p, mask_invalid) for t, p in _distinct(paths, dedup, cap)]
    return rows


# --- OpenManus-RL import ----------------------------------------------------------------------------
_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "system": "system", "tool": "user", "observation": "user"}


def openmanus_rows(path: str | Path, tokenizer: TurnEncoder | None = None) -> list[dict[str, Any]]:
    """SFT rows from the OpenManus-RL format (JSON list or JSONL of
    ``{id, conversations: [{role, content}]}``; ShareGPT's ``from``/``value`` also accepted).
    Segments are filled when ``tokenizer`` is given, else left empty (the trainer encodes)."""
    path = Path(path)
    try:
        text = read_utf8(path)
    except OSError as exc:
        raise ExportError(f"{path}: {exc.strerror}") from None
    except ValueError as exc:  # a byte that is not UTF-8: file:line
        raise ExportError(str(exc)) from None
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = list(enumerate(json.loads(text), 1))
        else:
            records = [(i, json.loads(ln)) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    rows = []
    for i, rec in records:
        where = f"{path}:{i}"
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            raise ExportError(f"{where}: missing 'conversations' list")
        msgs = []
        for j, turn in enumerate(rec["conversations"]):
            role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
            content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
            if role not in _ROLES or not isinstance(content, str):
                raise ExportError(f"{where}: turn {j}: needs a known role and string content")
            msgs.append({"role": _ROLES[role], "content": content})
        if not any(m["role"] == "assistant" for m in msgs):
            raise ExportError(f"{where}: empty trajectory (no assistant turn)")
        segs: list[dict[str, Any]] = []
        if tokenizer is not None:
            try:
                segs = segments_from_messages(msgs, tokenizer)
            except ValueError as exc:
                raise ExportError(f"{where}: {exc}") from None
        rows.append({"task_id": str(rec.get("id", i)), "env": "openmanus", "messages": msgs,
                     "segments": segs, "success": True, "reward": None,  # demonstrations: no env reward
                     "steps": sum(m["role"] == "assistant" for m in msgs)})
    return rows


