"""PRM step labels: per root-to-leaf path, each step's Monte-Carlo value, MCTS Q-value and label
(:mod:`reward_models.label_files`; ``omrl label`` adds fresh policy rollouts)."""
from __future__ import annotations

from typing import Any, Iterable

from .agent import TurnEncoder
from .export_common import ExportError, Renderer, finished_below, prompt_messages
from .result import SearchResult
from .tree import FAILED, Node, SearchTree

SOFT = ("mc", "q", "mean")  # what a PRM row's soft_labels hold


def label_paths(tree: SearchTree) -> list[list[Node]]:
    """Root-to-leaf paths (root excluded) worth labelling: no failed node, no duplicate-state
    prune at the end."""
    paths = []
    for leaf in tree.leaves():
        if leaf.parent is None or leaf.status == FAILED or leaf.error == "duplicate state":
            continue
        path = tree.path(leaf)[1:]
        if all(n.step is not None and n.status != FAILED for n in path):
            paths.append(path)
    return paths


def _soft(mc: float | None, q: float | None, how: str) -> float | None:
    if how != "mean":
        return q if how == "q" and q is not None else mc
    have = [v for v in (mc, q) if v is not None]
    return sum(have) / len(have) if have else None


def prm_rows(results: Iterable[SearchResult], *, soft: str = "mc", threshold: float = 0.5,
             tree_leaves: bool = True, extra: dict[tuple[int, int], tuple[int, int]] | None = None,
             segments: bool = True, tokenizer: TurnEncoder | None = None,
             override: dict[tuple[int, int], float] | None = None) -> list[dict[str, Any]]:
    """PRM label rows, one per labelled root-to-leaf path. A step's Monte-Carlo value is the
    share of successful finished leaves below its node (``tree_leaves``) plus ``extra`` rollouts
    (``{(result index, node id): (successes, rollouts)}``, what ``omrl label`` samples); a
    terminal step's value is its own success. ``soft_labels`` per ``soft``, ``labels`` =
    ``soft_labels >= threshold``; a path is cut before its first step without a value.
    ``override`` (``{(result index, node id): value}``, e.g. exact labels) replaces the
    ``soft`` choice for every node it holds; the others keep it."""
    if soft not in SOFT:
        raise ExportError(f"soft must be one of {', '.join(SOFT)}, got {soft!r}")
    if not 0.0 < threshold <= 1.0:
        raise ExportError(f"need 0 < threshold <= 1, got {threshold}")
    r, extra = Renderer(tokenizer), extra or {}
    rows = []
    for i, res in enumerate(results):
        tree = res.tree
        below = finished_below(tree) if tree_leaves else {}
        for path in label_paths(tree):
            mc, n_mc, q, visits = [], [], [], []
            for node in path:
                wins, count = (int(node.success), 1) if node.terminal else [
                    a + b for a, b in zip(below.get(node.id, (0, 0)), extra.get((i, node.id), (0, 0)))]
                mc.append(wins / count if count else None)
                n_mc.append(count)
                q.append(min(max(node.value_sum / node.visits, 0.0), 1.0) if node.visits else None)
                visits.append(node.visits)
            target = [_soft(m, qv, soft) if override is None or (i, n.id) not in override
                      else override[(i, n.id)] for n, m, qv in zip(path, mc, q)]
            cut = target.index(None) if None in target else len(target)
            if cut == 0:
                continue
            path, mc, n_mc, q, visits, target = (x[:cut] for x in (path, mc, n_mc, q, visits, target))
            rows.append({
                "prompt": prompt_messages(tree.task, tree.root.observation, r.format(tree)),
                "completions": [n.step.completion for n in path],
                "labels": [t >= threshold for t in target], "soft_labels": target,
                "mc_values": mc, "mc_rollouts": n_mc, "q_values": q, "visits": visits,
                "observations": [n.step.observation for n in path],
                "segments": r.segments(tree, [tree.root] + path, 1, False) if segments else [],
                "env": tree.task.env, "task_id": tree.task.task_id, "split": tree.task.split,
                "strategy": res.strategy, "success": bool(path[-1].terminal and path[-1].success),
                "terminal": bool(path[-1].terminal)})
    return rows

