"""GRPO groups: siblings expanded from one snapshot (any group size), with the behaviour logprobs
and the grammar each step was sampled under. Columns: see :mod:`omrl_search.exports`."""
from __future__ import annotations

from typing import Any, Iterable

from .agent import TurnEncoder
from .export_common import (Renderer, branch_groups, check_unit, cut_at, env_reward, node_values,
                            outcome, terminals_below)
from .result import SearchResult


def grpo_rows(results: Iterable[SearchResult], *, unit: str = "trajectory", value: str = "mc",
              min_group: int = 2, tokenizer: TurnEncoder | None = None,
              reward_model: Any = None) -> list[dict[str, Any]]:
    """Groups of continuations from one snapshot. ``unit="trajectory"``: every finished
    trajectory below a branch point is a member, its ``value`` the outcome (1 success, 0
    failure; best-of-N gives the classic GRPO group at the root); ``"step"``: each sibling's
    single turn, its ``value`` the sibling's node value. ``reward`` is the env's reward over the
    member's steps, ``success``/``terminal`` whether the member ended a solved / any episode.
    Rows carry the behaviour policy's logprobs in their segments, and each assistant segment the
    grammar its step was sampled under (``grammar``, None if unconstrained): under a grammar the
    logprobs are those of the masked, renormalised distribution, and a trainer rebuilds the same
    masks to compute its own (:mod:`train.data`).

    With a ``reward_model`` (a PRM, the implicit PRM: anything with ``score``), each row also
    gets ``process``: the model's value of the snapshot the group branched from (None at the
    root, which no step reached) followed by its value after each of the member's steps, one
    ``score`` call for all rows: the dense process rewards of :func:`train.losses.process_advantages`."""
    check_unit(unit)
    r = Renderer(tokenizer)
    rows, paths = [], []
    for res in results:
        tree = res.tree
        vals = node_values(tree, value) if unit == "step" else None
        for g, (parent, kids) in enumerate(branch_groups(tree)):
            if unit == "step":
                members = [(tree.path(k), vals[k.id]) for k in kids if vals[k.id] is not None]
            else:
                members = [(tree.path(leaf), outcome(leaf)) for k in kids
                           for leaf in terminals_below(tree, k)]
            if len(members) < min_group:
                continue
            depth = parent.depth + 1
            gid = f"{tree.task.task_id}/{parent.id}/{g}"
            for path, target in members:
                msgs = r.messages(tree, path)
                cut = cut_at(msgs, depth)
                last = path[-1]
                rows.append({"task_id": tree.task.task_id, "env": tree.task.env, "group_id": gid,
                             "prompt": msgs[:cut], "completion": msgs[cut:],
                             "segments": r.segments(tree, path, depth, mask_invalid=False, grammar=True),
                             "value": float(target), "reward": env_reward(path, depth),
                             "success": bool(last.terminal and last.success),
                             "terminal": bool(last.terminal)})
                paths.append((tree, path, depth))
    if reward_model is not None and rows:
        add_process_values(rows, paths, reward_model)
    return rows


def add_process_values(rows: list[dict[str, Any]], paths: list[tuple[Any, list, int]], rm: Any) -> None:
    """``row["process"]`` for each row from ``rm``'s step scores of its whole path (one call):
    ``[value before the member's first step (None at the root), value after each of its steps]``."""
    scores = rm.score([tree.trajectory(path[-1]) for tree, path, _ in paths])
    for row, (tree, path, depth), s in zip(rows, paths, scores):
        if isinstance(s, Exception):
            raise ValueError(f"{tree.task.task_id}: the reward model could not score a member: {s}")
        row["process"] = [float(s[depth - 2]) if depth >= 2 else None] + [float(v) for v in s[depth - 1:]]


