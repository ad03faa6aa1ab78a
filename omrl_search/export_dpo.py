"""DPO pairs from search trees: siblings expanded from one snapshot (the same prompt ids, so the
prefix is identical by construction) that the search's outcome tells apart.

``pairs`` chooses which siblings make a pair:

* ``"branch"`` (default): a **real branch point**: the chosen sibling leads to success (its
  subtree holds a successful finished trajectory) and the rejected one does not (its subtree was
  explored to at least one end, or its step was invalid, and holds no success). Pairs whose
  chosen side merely has a higher estimate, both sides possibly failing, teach the policy
  nothing it can use, and they make DPO lower the chosen side's likelihood too.
* ``"value"``: the older rule: node values (``value=``) that differ by at least ``margin``.
* ``"qgap"``: rStar-Math's and ReST-MCTS*'s choice for MCTS trees: siblings whose **Q values**
  (:func:`~omrl_search.export_common.q_values`: solver-proven wins and losses exact, other
  nodes their visit-weighted mean return) differ by at least ``margin``, each either proven or
  visited at least ``min_visits`` times, so a pair is not two noisy one-visit estimates. Unlike
  ``branch`` it also pairs two unsolved siblings when the search clearly preferred one.

``chosen_value`` / ``rejected_value`` hold the siblings' node values (``branch``: the share of
successful finished trajectories below each, Monte-Carlo; ``qgap``: their Q values).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from .agent import TurnEncoder
from .export_common import (ExportError, Renderer, branch_groups, check_unit, cut_at,
                            finished_below, node_values, outcome, q_values, terminals_below)
from .result import SearchResult
from .tree import Node, SearchTree

PAIRS = ("branch", "value", "qgap")


def _value_pairs(kids: list[Node], vals: list[float | None], margin: float
                 ) -> list[tuple[Node, Node, float, float]]:
    scored = sorted((k for k in kids if vals[k.id] is not None), key=lambda k: -vals[k.id])
    return [(a, b, vals[a.id], vals[b.id]) for i, a in enumerate(scored) for b in scored[i + 1:]
            if vals[a.id] - vals[b.id] >= margin]


def _qgap_pairs(kids: list[Node], q: dict[int, tuple[float, bool]], margin: float, min_visits: int
                ) -> list[tuple[Node, Node, float, float]]:
    known = sorted((k for k in kids if k.id in q and (q[k.id][1] or k.visits >= min_visits)),
                   key=lambda k: -q[k.id][0])
    return [(a, b, q[a.id][0], q[b.id][0]) for i, a in enumerate(known) for b in known[i + 1:]
            if q[a.id][0] - q[b.id][0] >= margin]


def _branch_pairs(kids: list[Node], below: dict[int, tuple[int, int]]
                  ) -> list[tuple[Node, Node, float, float]]:
    def mc(k: Node) -> float:
        wins, count = below[k.id]
        return wins / count if count else 0.0

    good = sorted((k for k in kids if below[k.id][0] > 0), key=lambda k: -mc(k))
    bad = [k for k in kids if below[k.id][0] == 0 and (below[k.id][1] > 0 or not k.step.valid)]
    return [(a, b, mc(a), 0.0) for a in good for b in bad]


def _pair_rule(tree: SearchTree, pairs: str, margin: float, value: str, min_visits: int
               ) -> Callable[[list[Node]], list[tuple[Node, Node, float, float]]]:
    """``kids -> pairs`` for one tree under the rule ``pairs`` (what it needs computed once)."""
    if pairs == "branch":
        below = finished_below(tree)
        return lambda kids: _branch_pairs(kids, below)
    if pairs == "qgap":
        q = q_values(tree)
        return lambda kids: _qgap_pairs(kids, q, margin, min_visits)
    vals = node_values(tree, value)
    return lambda kids: _value_pairs(kids, vals, margin)


def dpo_rows(results: Iterable[SearchResult], *, pairs: str = "branch", margin: float = 0.5,
             value: str = "mc", unit: str = "step", max_pairs: int = 4, min_visits: int = 2,
             tokenizer: TurnEncoder | None = None) -> list[dict[str, Any]]:
    """(chosen, rejected) siblings from one prompt, chosen by ``pairs`` (module docstring).
    ``unit="step"``: chosen/rejected are the siblings' single turns (step-level DPO);
    ``"trajectory"``: each continues to its best (chosen) / worst (rejected) finished
    trajectory. At most ``max_pairs`` per branch point, widest value gaps first."""
    check_unit(unit)
    if pairs not in PAIRS:
        raise ExportError(f"unknown pairs {pairs!r} (one of {', '.join(PAIRS)})")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) \
            or margin < 0:
        raise ExportError(f"dpo: margin must be a finite number >= 0, got {margin!r}")
    if isinstance(min_visits, bool) or not isinstance(min_visits, int) or min_visits < 1:
        raise ExportError(f"dpo: min_visits must be an integer >= 1, got {min_visits!r}")
    r = Renderer(tokenizer)
    rows = []
    for res in results:
        tree = res.tree
        pick = _pair_rule(tree, pairs, margin, value, min_visits)
        for parent, kids in branch_groups(tree):
            found = [p for p in pick(kids) if p[0].step.completion != p[1].step.completion]
            found.sort(key=lambda p: -(p[2] - p[3]))  # stable: ties keep the siblings' order
            depth = parent.depth + 1
            for n, (a, b, va, vb) in enumerate(found[:max_pairs]):
                ca, cb = _continuation(tree, a, unit, best=True), _continuation(tree, b, unit, best=False)
                msgs_a, msgs_b = r.messages(tree, ca), r.messages(tree, cb)
                cut = cut_at(msgs_a, depth)
                rows.append({
                    "task_id": tree.task.task_id, "env": tree.task.env,
                    "pair_id": f"{tree.task.task_id}/{parent.id}/{n}",
                    "prompt": msgs_a[:cut], "chosen": msgs_a[cut:], "rejected": msgs_b[cut:],
                    "chosen_segments": r.segments(tree, ca, depth, mask_invalid=False),
                    "rejected_segments": r.segments(tree, cb, depth, mask_invalid=False),
                    "chosen_value": va, "rejected_value": vb})
    return rows


def _continuation(tree: SearchTree, child: Node, unit: str, best: bool) -> list[Node]:
    if unit == "step":
        return tree.path(child)
    leaves = terminals_below(tree, child)
    if not leaves:
        return tree.path(child)
    leaf = (max if best else min)(leaves, key=lambda n: (outcome(n), -n.depth if best else n.depth))
    return tree.path(leaf)
