"""Success rates with their uncertainty, and paired comparisons on the same tasks.

A success rate is only worth printing with its task count and a 95% interval (Wilson's score
interval: it behaves at 0 and at n, where the normal approximation does not), and two settings
run on the same tasks are compared with a paired test: exact McNemar (a two-sided binomial
test on the discordant tasks, i.e. those one setting solved and the other did not). The
statistics themselves come from scipy; this module only names them and shapes their answers.
See docs/design.md §8.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from scipy.stats import binomtest

#: the confidence level of every interval this project prints
LEVEL = 0.95


def wilson(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of ``successes`` out of ``n`` (``(0.0, 1.0)`` when ``n == 0``)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(successes, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def rate(successes: int, n: int, level: float = LEVEL) -> dict[str, float | int]:
    """``{tasks, successes, success_rate, ci_low, ci_high}`` for a summary row."""
    low, high = wilson(successes, n, level)
    return {"tasks": n, "successes": successes,
            "success_rate": round(successes / n, 4) if n else 0.0,
            "ci_low": round(low, 4), "ci_high": round(high, 4)}


def mcnemar_p(b_only: int, a_only: int) -> float:
    """Exact McNemar's two-sided p-value from the discordant counts (1.0 when there are none)."""
    discordant = a_only + b_only
    return float(binomtest(b_only, discordant, 0.5).pvalue) if discordant else 1.0


def mcnemar(a: Mapping[str, bool], b: Mapping[str, bool]) -> dict[str, float | int]:
    """Exact McNemar test of ``b`` against ``a`` on the tasks both ran (keyed by task id).

    Returns the number of shared tasks, the discordant counts (``b_only``: solved by ``b``
    alone; ``a_only``: by ``a`` alone), the difference in success rate ``b - a`` on the shared
    tasks and the two-sided p-value to 4 significant digits (1.0 when no task is discordant;
    never rounded to 0, which would read as certainty)."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two runs share no task: a paired test needs the same tasks")
    b_only = sum(1 for t in shared if b[t] and not a[t])
    a_only = sum(1 for t in shared if a[t] and not b[t])
    p = mcnemar_p(b_only, a_only)
    return {"tasks": len(shared), "b_only": b_only, "a_only": a_only,
            "diff": round((b_only - a_only) / len(shared), 4), "p_value": float(f"{p:.4g}")}


def outcomes(results: Iterable) -> dict[str, bool]:
    """``task_id -> success`` of a run's :class:`~omrl_search.result.SearchResult` s (or of
    dicts with ``task``/``success`` as read back from results.jsonl, or with ``task_id`` and
    ``success`` as in a bench's outcomes.jsonl)."""
    out: dict[str, bool] = {}
    for r in results:
        if isinstance(r, dict):
            tid = r["task_id"] if "task_id" in r else r["task"]["task_id"]
            out[tid] = bool(r["success"])
        else:
            out[r.task.task_id] = bool(r.success)
    return out


def paired(baseline: str, a: Mapping[str, bool], b: Mapping[str, bool]) -> dict[str, float | int | str]:
    """The ``paired`` block of a summary row: :func:`mcnemar` of ``b`` against ``a`` (the run
    named ``baseline``), with that name under ``vs``."""
    return {"vs": baseline, **mcnemar(a, b)}


def fmt_paired(block: Mapping[str, float | int | str]) -> str:
    """``"+0.07 (20 vs 5) p=0.0041"``: the difference in success rate against the baseline, the
    tasks only this run solved vs only the baseline solved, and the exact McNemar p-value."""
    return f"{block['diff']:+.2f} ({block['b_only']} vs {block['a_only']}) p={block['p_value']:.2g}"


def fmt_rate(row: Mapping[str, float | int]) -> str:
    """``"7/20 = 0.35 [0.18, 0.57]"``: a rate as the tables print it."""
    return (f"{row['successes']}/{row['tasks']} = {row['success_rate']:.2f} "
            f"[{row['ci_low']:.2f}, {row['ci_high']:.2f}]")
