"""Countdown (TinyZero-style): reach a target from 3-6 numbers, each used exactly once.

Tasks are generated with a known solution: pick the numbers, then combine *all* of them in a
random order with random operations whose intermediate results stay positive integers; the final
value is the target. Candidates come from ``random.Random`` seeded by ``(split, index)``; a stable
hash of the puzzle decides which split it belongs to (others are skipped), so the splits are
disjoint and every call returns the same list.

Difficulty knobs (``tasks(split, limit, numbers=4, target=(10, 99))``, or in the split:
``--split test:numbers=4,target=10-99``): ``numbers``, how many numbers (3 to 6; default a mix),
``target``, its range (default 10-999), and ``level``, 1 (3 numbers), 2 (4) or 3 (5-6), which
the task data also records. Tasks with knobs come from their own seeded stream (a split of up to
the default size each), still split by the puzzle's hash. ``answer=on`` (default off) ends an
episode only with ``answer EXPR`` once the target is reached, as Game24's knob does.
"""
from __future__ import annotations

import random
from functools import lru_cache
from typing import Any, NamedTuple

from omrl_search.env import register_env, stable_hash
from omrl_search.types import Task

from ._text_env import Range, knob_label
from .arith import ArithmeticEnv, answer_step_of, arith_knobs, check_numbers, instruction

SPLIT_SIZES = {"train": 1000, "test": 200}
TEST_PERCENT = 20
TARGET_RANGE = (10, 999)
BIG_NUMBERS = (25, 50, 75, 100)
COUNTS = (3, 4, 4, 5, 5, 6)  # how many numbers, drawn uniformly from this (the default mix)
KNOBS = {"level": (1, 3), "numbers": (3, 6), "target": (1, 100_000)}
LEVEL_COUNTS = {1: (3,), 2: (4,), 3: (5, 6)}
MAX_DRAWS = 500  # number draws per candidate before it is given up (narrow target ranges)


class Spec(NamedTuple):
    """What a stream of puzzles is drawn from: the counts of numbers and the target range."""

    counts: tuple[int, ...] = COUNTS
    target: Range = TARGET_RANGE
    label: str = ""  # the knobs as a split says them ("" for the default stream)


def spec_of(knobs: dict[str, Range]) -> Spec:
    """The stream for ``knobs`` (see the module docstring); one ValueError line when the knobs
    leave no size of puzzle."""
    if not knobs:
        return Spec()
    counts = COUNTS
    if "level" in knobs:
        lo, hi = knobs["level"]
        counts = tuple(c for level in range(lo, hi + 1) for c in LEVEL_COUNTS[level])
    if "numbers" in knobs:
        lo, hi = knobs["numbers"]
        counts = tuple(c for c in dict.fromkeys(counts) if lo <= c <= hi)
    if not counts:
        raise ValueError(f"countdown: the knobs {knob_label(knobs)} leave no puzzle size")
    return Spec(counts, knobs.get("target", TARGET_RANGE), knob_label(knobs))


def level_of(count: int) -> int:
    return next(level for level, counts in LEVEL_COUNTS.items() if count in counts)


def split_of(numbers, target: int) -> str:
    key = ("countdown", tuple(sorted(numbers)), target)
    return "test" if int(stable_hash(key), 16) % 100 < TEST_PERCENT else "train"


def _combine_all(rng: random.Random, numbers: list[int], high: int = TARGET_RANGE[1]) -> int | None:
    """Fold all numbers into one with random ops keeping positive integers; None if stuck."""
    pool = list(numbers)
    while len(pool) > 1:
        a, b = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
        a, b = max(a, b), min(a, b)
        ops = ["+"]
        if a * b <= 2 * high and b > 1:
            ops.append("*")
        if a > b:
            ops.append("-")
        if b > 1 and a % b == 0:
            ops.append("/")
        op = rng.choice(ops)
        pool.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b)
    return pool[0]


def generate(rng: random.Random, spec: Spec = Spec()) -> tuple[tuple[int, ...], int] | None:
    """One puzzle ``(sorted numbers, target)`` with a guaranteed solution (None when
    ``MAX_DRAWS`` draws found no target in range)."""
    low, high = spec.target
    for _ in range(MAX_DRAWS):
        count = rng.choice(spec.counts)
        numbers = [rng.randint(1, 25) for _ in range(count)]
        if rng.random() < 0.3:
            numbers[0] = rng.choice(BIG_NUMBERS)
        for _ in range(10):
            target = _combine_all(rng, numbers, high)
            if low <= target <= high and target not in numbers:
                return tuple(sorted(numbers)), target
    return None


@lru_cache(maxsize=16)
def puzzles(split: str, spec: Spec = Spec()) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The split's puzzles, in generation order (computed once per process): ``SPLIT_SIZES``
    of them, fewer when the knobs allow fewer distinct puzzles (none: a ValueError line)."""
    out: dict[tuple, None] = {}
    stream = f"countdown:{split}:{spec.label}:" if spec.label else f"countdown:{split}:"
    for index in range(50 * SPLIT_SIZES[split]):
        if len(out) >= SPLIT_SIZES[split]:
            break
        puzzle = generate(random.Random(f"{stream}{index}"), spec)
        if puzzle is not None and split_of(*puzzle) == split:
            out.setdefault(puzzle)
        if not out and index >= 200:
            break
    if not out:
        raise ValueError(f"countdown: no puzzle has the knobs {spec.label} (widen the target range)")
    return tuple(out)


@register_env("countdown")
class CountdownEnv(ArithmeticEnv):
    """Countdown over the exact arithmetic base; a task allows ``2 * len(numbers)`` steps."""

    description = (
        "Countdown: combine 3-6 numbers with + - * / to reach the target, each number used exactly once."
    )
    max_steps = 12

    def limit_for(self, numbers: list[int]) -> int:
        return 2 * len(numbers)

    @staticmethod
    def make_task(numbers, target: int, split: str, task_id: str | None = None, seed: int = 0,
                  answer_step: bool = False) -> Task:
        nums = sorted(numbers)
        data = {"numbers": nums, "target": target, "level": level_of(len(nums))}
        if answer_step:
            data["answer_step"] = True
        return Task(
            env="countdown",
            task_id=task_id or f"countdown-{'-'.join(map(str, nums))}-to-{target}",
            split=split,
            seed=seed,
            instruction=instruction(nums, target, answer_step),
            data=data,
        )

    @classmethod
    def tasks(cls, split: str, limit: int | None = None, *, level: Any = None, numbers: Any = None,
              target: Any = None, answer: Any = None) -> list[Task]:
        """The split's puzzles; the knobs (also in ``split``) are in the module docstring."""
        given = {"level": level, "numbers": numbers, "target": target}
        split, knobs, answer_step = arith_knobs("countdown", split, given, KNOBS, answer, tuple(SPLIT_SIZES))
        chosen = puzzles(split, spec_of(knobs))[:limit]
        return [cls.make_task(nums, goal, split, seed=i, answer_step=answer_step)
                for i, (nums, goal) in enumerate(chosen)]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        nums = check_numbers(row, range(3, 7), 1, 10_000)
        target = row.get("target")
        if type(target) is not int or not 1 <= target <= 1_000_000:
            raise ValueError(f"target must be an integer from 1 to 1000000, got {target!r}")
        task_id = row.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(nums, target, split=row.get("split", "test"), task_id=task_id,
                             answer_step=answer_step_of(row))
