"""Step-level metrics of a reward model against (soft) labels, in plain Python (the paired
bootstrap of two scorers, :func:`paired_auc`, uses numpy).

A step is *positive* when its soft label is at least ``threshold`` (0.5 by default; the same rule
writes the boolean ``labels`` column of label files).
"""
from __future__ import annotations

import math
from typing import Sequence


def roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """Area under the ROC curve (Mann-Whitney U, ties counted half); None without both classes."""
    pairs = sorted(zip(scores, positive), key=lambda p: p[0])
    n_pos = sum(1 for _, y in pairs if y)
    n_neg = len(pairs) - n_pos
    if not n_pos or not n_neg:
        return None
    rank_sum, i = 0.0, 0
    while i < len(pairs):  # average ranks over runs of equal scores
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        avg = (i + 1 + j) / 2
        rank_sum += avg * sum(1 for k in range(i, j) if pairs[k][1])
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    n = len(xs)
    if n < 2:
        return None
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def step_metrics(scores: Sequence[float], soft: Sequence[float], threshold: float = 0.5) -> dict:
    """``auc``, ``accuracy`` (score and label on the same side of ``threshold``), ``bce`` against
    the soft labels, ``steps`` and ``positives``; ``auc_any``: AUC against "some rollout
    succeeded" (soft label > 0, Math-Shepherd's hard estimate); ``pearson`` with the soft labels."""
    if len(scores) != len(soft):
        raise ValueError(f"{len(scores)} scores for {len(soft)} labels")
    positive = [y >= threshold for y in soft]
    n = len(scores)
    eps = 1e-7
    bce = -math.fsum(y * math.log(min(max(p, eps), 1 - eps)) + (1 - y) * math.log(min(max(1 - p, eps), 1 - eps))
                     for p, y in zip(scores, soft)) / n if n else None
    acc = sum((p >= threshold) == y for p, y in zip(scores, positive)) / n if n else None
    auc = roc_auc(scores, positive)
    auc_any = roc_auc(scores, [y > 0 for y in soft])
    r = pearson(scores, soft)
    return {"auc": None if auc is None else round(auc, 4),
            "auc_any": None if auc_any is None else round(auc_any, 4),
            "pearson": None if r is None else round(r, 4),
            "accuracy": None if acc is None else round(acc, 4),
            "bce": None if bce is None else round(bce, 4), "steps": n, "positives": sum(positive)}


def paired_auc(scores_a: Sequence[float], scores_b: Sequence[float], positive: Sequence[bool],
               groups: Sequence[str], resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Two scorers' AUC on the same steps, and the difference ``b - a`` with a bootstrap interval
    and two-sided p-value. Steps of one task are not independent (they share prefixes and an
    outcome), so the bootstrap draws whole tasks (``groups``: each step's task id) with
    replacement, as a paired comparison on the same tasks should. The p-value is twice the
    smaller share of resampled differences on either side of 0 (at least ``1 / resamples``)."""
    import numpy as np

    if not len(scores_a) == len(scores_b) == len(positive) == len(groups):
        raise ValueError("paired_auc needs one score of each scorer, one label and one group per step")
    pos = np.asarray(positive, dtype=bool)
    task_ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    task = np.array([task_ids[g] for g in groups])

    def auc(scores, w):  # weighted Mann-Whitney U over the distinct scores, ties counted half
        pw = np.bincount(scores, weights=w * pos, minlength=scores.max() + 1)
        nw = np.bincount(scores, weights=w * ~pos, minlength=scores.max() + 1)
        den = pw.sum() * nw.sum()
        return float((pw * (np.cumsum(nw) - nw / 2)).sum() / den) if den > 0 else float("nan")

    ranks = [np.unique(np.asarray(s, dtype=float), return_inverse=True)[1] for s in (scores_a, scores_b)]
    one = np.ones(len(pos))
    point = [auc(r, one) for r in ranks]
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        w = np.bincount(rng.integers(0, len(task_ids), len(task_ids)), minlength=len(task_ids))[task]
        diffs.append(auc(ranks[1], w) - auc(ranks[0], w))
    diffs = np.asarray([d for d in diffs if d == d])  # a resample without both classes says nothing
    tail = (1 - level) / 2
    p = max(2 * min((diffs <= 0).mean(), (diffs >= 0).mean()), 1 / len(diffs)) if len(diffs) else 1.0
    return {"steps": len(pos), "tasks": len(task_ids), "positives": int(pos.sum()),
            "auc_a": round(point[0], 4), "auc_b": round(point[1], 4),
            "diff": round(point[1] - point[0], 4),
            "ci_low": round(float(np.quantile(diffs, tail)), 4) if len(diffs) else None,
            "ci_high": round(float(np.quantile(diffs, 1 - tail)), 4) if len(diffs) else None,
            "p_value": float(f"{min(p, 1.0):.4g}"), "resamples": int(len(diffs))}
