"""Game of 24: make 24 from four numbers 1..13 with + - * /, each number used once.

The task set is every solvable multiset of four numbers (enumerated once with the exact solver);
a stable hash of the puzzle puts about 20% of them in the test split, so train and test never
share a puzzle, and each split is listed in a fixed hash order that mixes difficulties.

Difficulty is the solver's: ``good_moves``, how many of the distinct first combines keep 24
reachable (1 to 21 of 10 to 36), in the task data with ``level`` (3: at most 3 good first
moves, 2: 4 to 7, 1: 8 or more; about a third of the puzzles each). ``tasks(split, limit,
level=2)`` or the split ``"test:level=2"`` (``--split test:level=2``) keeps one level, or a
range (``level=2-3``).

``answer=on`` (``--split test:answer=on``; default off) adds the answer step of Tree-of-Thoughts'
Game24 protocol: with 24 left the episode ends only with ``answer EXPR``, the whole expression
(see :mod:`envs.arith`); the task data then says ``"answer_step": true``.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations, combinations_with_replacement
from typing import Any

from omrl_search.env import register_env, stable_hash
from omrl_search.types import Task

from .arith import ArithmeticEnv, answer_step_of, arith_knobs, check_numbers, instruction, solvable

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


LEVELS = ((8, 1), (4, 2), (0, 3))  # (least good first moves, level)


def _results(a: float, b: float) -> list[float]:
    out = [a + b, a * b, a - b, b - a]
    out += [a / b] if b else []
    out += [b / a] if a else []
    return out


def _reach3(a: float, b: float, c: float) -> bool:
    """Whether three numbers make 24 (floats: a difficulty label, 50x faster than exact)."""
    for x, y, z in ((a, b, c), (a, c, b), (b, c, a)):
        for v in _results(x, y):
            if any(abs(w - TARGET) < 1e-9 for w in _results(v, z)):
                return True
    return False


@lru_cache(maxsize=4096)
def good_moves(numbers: tuple[int, ...]) -> int:
    """How many distinct first combines of a sorted 4-number puzzle keep 24 reachable (the
    moves ``valid_actions()`` lists, commutative ones once)."""
    seen: dict[tuple, bool] = {}
    for i, j in combinations(range(len(numbers)), 2):
        a, b = float(numbers[i]), float(numbers[j])
        rest = [float(numbers[k]) for k in range(len(numbers)) if k not in (i, j)]
        moves = [((a, "+", b), a + b), ((a, "*", b), a * b), ((a, "-", b), a - b), ((b, "-", a), b - a)]
        moves += [((a, "/", b), a / b)] if b else []
        moves += [((b, "/", a), b / a)] if a and a != b else []
        for key, value in moves:
            seen[key] = seen.get(key) or _reach3(value, *rest)
    return sum(seen.values())


def level_of(good: int) -> int:
    """1 (easy) to 3 (hard) from the number of good first moves."""
    return next(level for least, level in LEVELS if good >= least)


@register_env("game24")
class Game24Env(ArithmeticEnv):
    """Game of 24 over the exact arithmetic base; 3 combines solve it, 6 steps allowed."""

    description = "Game of 24: combine four numbers with + - * / to make 24, each number used once."
    max_steps = 6

    @staticmethod
    def make_task(numbers, split: str | None = None, task_id: str | None = None,
                  answer_step: bool = False) -> Task:
        nums = sorted(numbers)
        good = good_moves(tuple(nums))
        data = {"numbers": nums, "target": TARGET, "good_moves": good, "level": level_of(good)}
        if answer_step:
            data["answer_step"] = True
        return Task(
            env="game24",
            task_id=task_id or "game24-" + "-".join(map(str, nums)),
            split=split or split_of(tuple(nums)),
            seed=0,
            instruction=instruction(nums, TARGET, answer_step),
            data=data,
        )

    @classmethod
    def tasks(cls, split: str, limit: int | None = None, *, level: int | str | None = None,
              answer: bool | str | None = None) -> list[Task]:
        """The split's puzzles (see the module docstring for ``level`` and ``answer``, also in
        ``split``)."""
        split, knobs, answer_step = arith_knobs("game24", split, {"level": level}, {"level": (1, 3)}, answer)
        puzzles = split_puzzles(split)
        if "level" in knobs:
            lo, hi = knobs["level"]
            puzzles = tuple(p for p in puzzles if lo <= level_of(good_moves(p)) <= hi)
        return [cls.make_task(p, split, answer_step=answer_step) for p in puzzles[:limit]]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        nums = check_numbers(row, range(4, 5), 1, 13)
        if row.get("target", TARGET) != TARGET:
            raise ValueError(f"game24 target must be 24, got {row['target']!r}")
        task_id = row.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(nums, split=row.get("split", "test"), task_id=task_id,
                             answer_step=answer_step_of(row))
