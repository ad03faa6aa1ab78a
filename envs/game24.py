"""Game of 24: make 24 from four numbers 1..13 with + - * /, each number used once.

The task set is every solvable multiset of four numbers (enumerated once with the exact solver);
a stable hash of the puzzle puts about 20% of them in the test split, so train and test never
share a puzzle, and each split is listed in a fixed hash order that mixes difficulties.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations_with_replacement
from typing import Any

from omrl_search.env import register_env, stable_hash
from omrl_search.types import Task

from .arith import ArithmeticEnv, check_numbers, solvable

TARGET = 24
TEST_PERCENT = 20


def split_of(numbers: tuple[int, ...]) -> str:
    """``test`` for about 20% of puzzles, ``train`` otherwise (stable across processes)."""
    bucket = int(stable_hash(("game24", tuple(sorted(numbers)))), 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


@lru_cache(maxsize=1)
def all_puzzles() -> tuple[tuple[int, ...], ...]:
    """Every solvable sorted 4-multiset of 1..13 (computed once per process)."""
    return tuple(p for p in combinations_with_replacement(range(1, 14), 4) if solvable(p, TARGET))


@lru_cache(maxsize=2)
def split_puzzles(split: str) -> tuple[tuple[int, ...], ...]:
    """The split's puzzles in a fixed pseudo-random order (so any prefix mixes difficulties)."""
    chosen = (p for p in all_puzzles() if split_of(p) == split)
    return tuple(sorted(chosen, key=lambda p: stable_hash(("order", p))))


@register_env("game24")
class Game24Env(ArithmeticEnv):
    """Game of 24 over the exact arithmetic base; 3 combines solve it, 6 steps allowed."""

    description = "Game of 24: combine four numbers with + - * / to make 24, each number used once."
    max_steps = 6

    @staticmethod
    def make_task(numbers, split: str | None = None, task_id: str | None = None) -> Task:
        nums = sorted(numbers)
        shown = " ".join(map(str, nums))
        return Task(
            env="game24",
            task_id=task_id or "game24-" + "-".join(map(str, nums)),
            split=split or split_of(tuple(nums)),
            seed=0,
            instruction=(
                f"Use the numbers {shown} and + - * / to make 24. Each number must be used exactly "
                "once. Combine two numbers per step (e.g. `4 * 6`), or give the whole expression "
                "with `answer EXPR` (e.g. `answer (1 + 2 + 3) * 4`)."
            ),
            data={"numbers": nums, "target": TARGET},
        )

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"game24 has splits 'train' and 'test', not {split!r}")
        return [cls.make_task(p, split) for p in split_puzzles(split)[:limit]]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        nums = check_numbers(row, range(4, 5), 1, 13)
        if row.get("target", TARGET) != TARGET:
            raise ValueError(f"game24 target must be 24, got {row['target']!r}")
        task_id = row.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(nums, split=row.get("split", "test"), task_id=task_id)
