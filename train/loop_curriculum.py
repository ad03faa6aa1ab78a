"""The loop's curriculum: train where the current policy's search succeeds sometimes, not always.

Group-relative updates (GRPO, DPO pairs, rejection sampling) learn nothing from tasks the policy
always solves or never solves: every sample gets the same reward. So each round, before its
search, the loop *probes* every difficulty level of the curriculum — ``probe_limit`` train tasks
per level, searched with the round's policy, PRM, strategy and budget — and the round then
searches and trains on the levels whose success rate is within ``[low, high]`` (10%-90% by
default). When none is, the level nearest to that band is taken (the easiest one when everything
is too hard, the hardest when everything is too easy), and the report says so.

A level is a difficulty knob of the env's task generator given in the split string
(docs/environments.md): ``curriculum: {knob: level, levels: [1, 2, 3]}`` probes
``train:level=1`` ... ; ``levels`` may also be whole knob strings without ``knob``
(``levels: ["numbers=3", "numbers=4,target=10-99"]``). Probe tasks never include a dev-slice
puzzle (:mod:`train.loop_select`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

import omrl_search as om
from omrl_search.types import Task

from .config import TrainError
from .loop_select import without


class CurriculumSettings(BaseModel):
    """``curriculum:`` in a loop config."""

    model_config = ConfigDict(extra="forbid")
    knob: str | None = "level"  # None: each level is a whole knob string
    levels: list[str | int] = Field(min_length=1)
    low: float = Field(0.1, ge=0, le=1)
    high: float = Field(0.9, ge=0, le=1)
    probe_limit: int = Field(16, ge=1)  # train tasks searched per level, per round

    @model_validator(mode="after")
    def _band(self) -> "CurriculumSettings":
        if self.low > self.high:
            raise ValueError(f"curriculum: low {self.low} is above high {self.high}")
        return self

    def split(self, level: str | int) -> str:
        """The train split string of ``level`` (``train:level=2``)."""
        return f"train:{self.knob}={level}" if self.knob else f"train:{level}"

    def names(self) -> list[str]:
        return [str(level) for level in self.levels]


def level_tasks(env: str, cur: CurriculumSettings, level: str | int, held: Sequence[Task],
                start: int = 0, limit: int | None = None, exact: bool = False) -> list[Task]:
    """The train tasks of ``level`` without ``held`` puzzles (the dev slice), ``[start:start+limit]``;
    with ``exact``, one TrainError line when the level has fewer than that."""
    tasks = without(om.load_tasks(env, cur.split(level)), held)
    if exact and limit is not None and start + limit > len(tasks):
        raise TrainError(f"curriculum: level {level!r} of {env} has {len(tasks)} train tasks, "
                         f"not the {start + limit} this round's fresh train tasks need")
    return tasks[start:] if limit is None else tasks[start:start + limit]


def check_levels(env: str, cur: CurriculumSettings) -> None:
    """Each level's split loads (one ValueError line naming the bad knob otherwise)."""
    for level in cur.levels:
        if not om.load_tasks(env, cur.split(level), 1):
            raise ValueError(f"curriculum: level {level!r} of {env} has no train tasks")


def choose(rates: dict[str, float], low: float, high: float) -> tuple[list[str], str]:
    """The levels to train on (in the curriculum's order) and why."""
    inside = [name for name, r in rates.items() if low <= r <= high]
    if inside:
        return inside, f"search success within [{low:g}, {high:g}]"

    def distance(r: float) -> float:
        return low - r if r < low else r - high

    names = list(rates)
    # nearest to the band; on a tie the easier level below it, the harder one above it
    pick = min(names, key=lambda n: (distance(rates[n]), names.index(n) * (1 if rates[n] < low else -1)))
    where = "below" if rates[pick] < low else "above"
    return [pick], (f"no level within [{low:g}, {high:g}]: the nearest, {pick} "
                    f"({rates[pick]:.2f}, {where} the band)")


def probe(env: str, cur: CurriculumSettings, held: Sequence[Task],
          searcher: Callable[[list[Task]], list[Any]],
          starts: dict[str, int] | None = None) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Search ``probe_limit`` tasks per level (from ``starts[level]``, fresh train tasks: all of
    them there); ``({"rates", "counts", "chosen", "reason"}, {level: results})``."""
    results: dict[str, list[Any]] = {}
    counts: dict[str, list[int]] = {}
    for level, name in zip(cur.levels, cur.names()):
        tasks = level_tasks(env, cur, level, held, (starts or {}).get(name, 0), cur.probe_limit,
                            exact=starts is not None)
        results[name] = searcher(tasks) if tasks else []
        counts[name] = [sum(bool(r.success) for r in results[name]), len(results[name])]
    rates = {n: (s / t if t else 0.0) for n, (s, t) in counts.items()}
    chosen, reason = choose(rates, cur.low, cur.high)
    return {"rates": {n: round(r, 4) for n, r in rates.items()}, "counts": counts,
            "chosen": chosen, "reason": reason}, results


def quotas(total: int, chosen: Sequence[str]) -> dict[str, int]:
    """Train tasks per chosen level for a round searching ``total`` tasks."""
    return {name: math.ceil(total / len(chosen)) for name in chosen}


def taken(cur: CurriculumSettings, chosen: Sequence[str], total: int) -> dict[str, int]:
    """How many of each level's train tasks a round searching ``total`` took: the probe's, and
    the rest of a chosen level's quota after them (the search reuses the probed tasks)."""
    want = quotas(total, chosen)
    return {name: max(cur.probe_limit, want.get(name, 0)) for name in cur.names()}
