"""Countdown (TinyZero-style): reach a target from 3-6 numbers, each used exactly once.

Tasks are generated with a known solution: pick the numbers, then combine *all* of them in a
random order with random operations whose intermediate results stay positive integers; the final
value is the target. Candidates come from ``random.Random`` seeded by ``(split, index)``; a stable
hash of the puzzle decides which split it belongs to (others are skipped), so the splits are
disjoint and every call returns the same list.
"""
from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from omrl_search.env import register_env, stable_hash
from omrl_search.types import Task

from .arith import ArithmeticEnv, check_numbers

SPLIT_SIZES = {"train": 1000, "test": 200}
TEST_PERCENT = 20
TARGET_RANGE = (10, 999)
BIG_NUMBERS = (25, 50, 75, 100)


def split_of(numbers, target: int) -> str:
    key = ("countdown", tuple(sorted(numbers)), target)
    return "test" if int(stable_hash(key), 16) % 100 < TEST_PERCENT else "train"


def _combine_all(rng: random.Random, numbers: list[int]) -> int | None:
    """Fold all numbers into one with random ops keeping positive integers; None if stuck."""
    pool = list(numbers)
    while len(pool) > 1:
        a, b = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
        a, b = max(a, b), min(a, b)
        ops = ["+"]
        if a * b <= 2 * TARGET_RANGE[1] and b > 1:
            ops.append("*")
        if a > b:
            ops.append("-")
        if b > 1 and a % b == 0:
            ops.append("/")
        op = rng.choice(ops)
        pool.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b)
    return pool[0]


def generate(rng: random.Random) -> tuple[tuple[int, ...], int]:
    """One puzzle ``(sorted numbers, target)`` with a guaranteed solution."""
    while True:
        count = rng.choice((3, 4, 4, 5, 5, 6))
        numbers = [rng.randint(1, 25) for _ in range(count)]
        if rng.random() < 0.3:
            numbers[0] = rng.choice(BIG_NUMBERS)
        for _ in range(10):
            target = _combine_all(rng, numbers)
            if TARGET_RANGE[0] <= target <= TARGET_RANGE[1] and target not in numbers:
                return tuple(sorted(numbers)), target


@lru_cache(maxsize=2)
def puzzles(split: str) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The split's puzzles, in generation order (computed once per process)."""
    out: dict[tuple, None] = {}
    index = 0
    while len(out) < SPLIT_SIZES[split]:
        puzzle = generate(random.Random(f"countdown:{split}:{index}"))
        index += 1
        if split_of(*puzzle) == split:
            out.setdefault(puzzle)
    return tuple(out)


@register_env("countdown")
class CountdownEnv(ArithmeticEnv):
    """Countdown over the exact arithmetic base; a task allows ``2 * len(numbers)`` steps."""

    description = (
        "Countdown: combine 3-6 numbers with + - * / to reach the target, each number used exactly once."
    )
    examples = (
        "Think: 25 * 4 = 100 and 100 + 3 = 103 is the target, so first multiply 25 by 4.\n"
        "Act: 25 * 4"
    )
    max_steps = 12

    def limit_for(self, numbers: list[int]) -> int:
        return 2 * len(numbers)

    @staticmethod
    def make_task(numbers, target: int, split: str, task_id: str | None = None, seed: int = 0) -> Task:
        nums = sorted(numbers)
        shown = " ".join(map(str, nums))
        return Task(
            env="countdown",
            task_id=task_id or f"countdown-{'-'.join(map(str, nums))}-to-{target}",
            split=split,
            seed=seed,
            instruction=(
                f"Use the numbers {shown} and + - * / to make {target}. Every number must be used "
                "exactly once. Combine two numbers per step (e.g. `25 * 4`), or give the whole "
                "expression with `answer EXPR` (e.g. `answer 25 * 4 + 3`)."
            ),
            data={"numbers": nums, "target": target},
        )

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        if split not in SPLIT_SIZES:
            raise ValueError(f"countdown has splits 'train' and 'test', not {split!r}")
        chosen = puzzles(split)[:limit]
        return [cls.make_task(nums, target, split, seed=i) for i, (nums, target) in enumerate(chosen)]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        nums = check_numbers(row, range(3, 7), 1, 10_000)
        target = row.get("target")
        if type(target) is not int or not 1 <= target <= 1_000_000:
            raise ValueError(f"target must be an integer from 1 to 1000000, got {target!r}")
        task_id = row.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(nums, target, split=row.get("split", "test"), task_id=task_id)
