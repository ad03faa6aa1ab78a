"""The loop's dev slice and its keep-best rule: what training decisions look at.

The **dev slice** is the last ``dev_limit`` tasks of an env's train split. Every task the loop
trains on in a run (searched, probed by the curriculum, demonstrated by the solver) is drawn from
the train split *without* the dev slice's puzzles, compared by puzzle (:func:`puzzle_key`: env
and instruction, which states the whole puzzle), not by task id: a task id can differ for the
same puzzle (Countdown's knob streams, user files). The test split is never looked at by a
decision; it is only reported.

**Keep-best.** After each training stage the candidate policy is evaluated on the dev slice with
the dev strategies and compared, task by task, with the best checkpoint so far and with every
checkpoint that was the best before it (exact McNemar, :func:`omrl_search.stats.mcnemar`). The
candidate is rejected when, for any dev strategy, it is worse than any of them with
``p < alpha``; otherwise it is kept. A kept candidate becomes the best when its dev score (mean
success over the dev strategies) is strictly higher than the best's (``promote: better``, the
default), or always (``promote: not_worse``: the newest checkpoint the dev slice does not show
to be worse; a small dev slice cannot show the gains a round makes, and a tie is then not a
reason to throw one away). Comparing with every former best keeps a chain of small, each
insignificant, losses from drifting below an earlier checkpoint. The best is what the run hands
back; training continues from the best (``continue_from: best``, the default) or from the last
kept candidate (``kept``). See docs/loop.md.
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


PROMOTE = ("better", "not_worse")


def decide(candidate: Outcomes, best: Outcomes, alpha: float = 0.05, *, promote: str = "better",
           earlier: Mapping[str, Outcomes] | None = None) -> dict[str, Any]:
    """Whether to keep a candidate checkpoint given the best one's dev outcomes, and those of the
    checkpoints that were the best before it (``earlier``: where -> outcomes); ``promote`` says
    when a kept candidate becomes the best (module docstring).

    Returns ``{"keep", "new_best", "reason", "tests": {strategy: mcnemar block}, "earlier":
    {where: {strategy: mcnemar block}}, "score", "best_score"}``; a block's ``diff`` is candidate
    minus reference on the shared dev tasks."""
    if promote not in PROMOTE:
        raise ValueError(f"promote must be one of {', '.join(PROMOTE)}, got {promote!r}")
    tests = _tests(candidate, best)
    if not tests:
        raise ValueError("the candidate and the best share no dev strategy: nothing to compare")
    before = {where: _tests(candidate, outs) for where, outs in (earlier or {}).items()}
    worse = [(f"{n} significantly worse on dev than the best", t) for n, t in tests.items() if _worse(t, alpha)]
    worse += [(f"{n} significantly worse on dev than {where}", t)
              for where, per in before.items() for n, t in per.items() if _worse(t, alpha)]
    score, best_score = dev_score(candidate), dev_score(best)
    keep = not worse
    new_best = keep and (score > best_score or promote == "not_worse")
    if worse:
        reason = "; ".join(f"{what} ({_fmt(t)})" for what, t in worse)
    else:
        verdict = (": new best" if score > best_score else ": no better on dev, the newest kept as the best"
                   if new_best else ": not better than the best")
        reason = ("not significantly worse on dev (" + "; ".join(f"{n} {_fmt(t)}" for n, t in tests.items())
                  + (f"; nor than the earlier best: {'; '.join(before)}" if before else "")
                  + f"); dev score {score:.3f} vs best {best_score:.3f}" + verdict)
    return {"keep": keep, "new_best": new_best, "reason": reason, "tests": tests, "earlier": before,
            "score": round(score, 4), "best_score": round(best_score, 4)}


def _tests(candidate: Outcomes, reference: Outcomes) -> dict[str, dict[str, Any]]:
    from omrl_search.stats import mcnemar  # scipy: loaded when a decision is made

    return {name: mcnemar(reference[name], per) for name, per in candidate.items() if name in reference}


def _worse(t: Mapping[str, Any], alpha: float) -> bool:
    return t["diff"] < 0 and t["p_value"] < alpha


def _fmt(t: Mapping[str, Any]) -> str:
    return f"{t['diff']:+.3f}, {t['b_only']} vs {t['a_only']} tasks, p={t['p_value']:.3g}"
