"""The loop's dev slice and its keep-best rule: what training decisions look at.

The **dev slice** is the last ``dev_limit`` tasks of an env's train split. Every task the loop
trains on in a run (searched, probed by the curriculum, demonstrated by the solver) is drawn from
the train split *without* the dev slice's puzzles, compared by puzzle (:func:`puzzle_key`: env
and instruction, which states the whole puzzle), not by task id: a task id can differ for the
same puzzle (Countdown's knob streams, user files). The test split is never looked at by a
decision; it is only reported.

**Keep-best.** After each training stage the candidate policy is evaluated on the dev slice with
the dev strategies and compared, task by task, with the best checkpoint so far (exact McNemar,
:func:`omrl_search.stats.mcnemar`). The candidate is rejected when, for any dev strategy, it is
worse with ``p < alpha``; otherwise it is kept, and it becomes the best when its dev score (mean
success over the dev strategies) is strictly higher than the best's. The best is what the run
hands back; training continues from the best (``continue_from: best``, the default) or from the
last kept candidate (``kept``). See docs/loop.md.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from omrl_search.types import Task

#: task_id -> solved, per dev strategy name
Outcomes = Mapping[str, Mapping[str, bool]]


def puzzle_key(task: Task) -> tuple[str, str]:
    """What makes two tasks the same puzzle: the env and the instruction (which states the numbers
    and target, or the room), whatever their ids."""
    return task.env, " ".join(task.instruction.split())


def dev_slice(tasks: Sequence[Task], limit: int) -> list[Task]:
    """The dev slice of a train split's tasks: its last ``limit`` (none for 0)."""
    return list(tasks[len(tasks) - limit:]) if limit else []


def without(tasks: Sequence[Task], held: Sequence[Task]) -> list[Task]:
    """``tasks`` less every puzzle of ``held`` (by :func:`puzzle_key`)."""
    keys = {puzzle_key(t) for t in held}
    return [t for t in tasks if puzzle_key(t) not in keys]


def check_disjoint(train: Sequence[Task], held: Sequence[Task], what: str = "dev") -> None:
    """Raise ValueError naming a shared puzzle when ``train`` and ``held`` share one."""
    keys = {puzzle_key(t): t.task_id for t in held}
    for t in train:
        if puzzle_key(t) in keys:
            raise ValueError(f"training task {t.task_id} is the same puzzle as {what} task "
                             f"{keys[puzzle_key(t)]}")


def dev_score(outcomes: Outcomes) -> float:
    """Mean success rate over the dev strategies (what ranks kept checkpoints)."""
    rates = [sum(per.values()) / len(per) for per in outcomes.values() if per]
    return sum(rates) / len(rates) if rates else 0.0


def decide(candidate: Outcomes, best: Outcomes, alpha: float = 0.05) -> dict[str, Any]:
    """Whether to keep a candidate checkpoint given the best one's dev outcomes.

    Returns ``{"keep", "new_best", "reason", "tests": {strategy: mcnemar block}, "score",
    "best_score"}``; ``tests[s]["diff"]`` is candidate minus best on the shared dev tasks."""
    from omrl_search.stats import mcnemar  # scipy: loaded when a decision is made

    tests = {name: mcnemar(best[name], per) for name, per in candidate.items() if name in best}
    if not tests:
        raise ValueError("the candidate and the best share no dev strategy: nothing to compare")
    worse = [name for name, t in tests.items() if t["diff"] < 0 and t["p_value"] < alpha]
    score, best_score = dev_score(candidate), dev_score(best)
    keep = not worse
    new_best = keep and score > best_score
    if worse:
        reason = "; ".join(f"{n} significantly worse on dev ({_fmt(tests[n])})" for n in worse)
    else:
        reason = ("not significantly worse on dev (" + "; ".join(f"{n} {_fmt(t)}" for n, t in tests.items())
                  + f"); dev score {score:.3f} vs best {best_score:.3f}"
                  + (": new best" if new_best else ": not better than the best"))
    return {"keep": keep, "new_best": new_best, "reason": reason, "tests": tests,
            "score": round(score, 4), "best_score": round(best_score, 4)}


def _fmt(t: Mapping[str, Any]) -> str:
    return f"{t['diff']:+.3f}, {t['b_only']} vs {t['a_only']} tasks, p={t['p_value']:.3g}"
