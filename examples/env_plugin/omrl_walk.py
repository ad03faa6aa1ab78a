"""walk: an env plugin for omrl-search. Reach a goal on a number line with `left` / `right`.

The whole state is the plain value ``(position, goal)``, so :class:`ValueSnapshots` gives the
snapshots and state keys; ``expert_action`` lets ``scripted:oracle`` policies solve it, and
``tasks(split)`` gives fixed train and test goals. Installed with this folder's pyproject.toml,
``omrl search --env walk`` finds it through the ``omrl_search.envs`` entry point.
"""
from __future__ import annotations

from typing import Any

from omrl_search.env import Env, ValueSnapshots
from omrl_search.types import StepResult, Task

SPLITS = {"train": (-4, -2, 1, 3, 4), "test": (-3, 2, 5)}
MOVES = {"left": -1, "right": 1}


class WalkEnv(ValueSnapshots, Env):
    name = "walk"
    description = "Walk along a number line from 0 to the goal."
    action_help = "Actions: `left` or `right` (one step along the line)."
    max_steps = 12

    def reset(self, task: Task) -> str:
        self.state = (0, int(task.data["goal"]))
        return self.observe()

    def observe(self) -> str:
        pos, goal = self.state
        return f"You are at {pos}. The goal is at {goal}."

    def step(self, action: str) -> StepResult:
        move = MOVES.get(action.strip().lower())
        if move is None:
            return StepResult(f"Unknown action {action!r}. {self.action_help}", valid=False)
        pos, goal = self.state[0] + move, self.state[1]
        self.state = (pos, goal)
        won = pos == goal
        return StepResult(self.observe(), reward=float(won), terminated=won, success=won,
                          valid=True, info={"answer": str(pos)} if won else {})

    def valid_actions(self) -> list[str]:
        return list(MOVES)

    def expert_action(self) -> str | None:
        pos, goal = self.state
        return "right" if goal > pos else "left" if goal < pos else None

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"walk has splits 'train' and 'test', not {split!r}")
        return [cls.task_from_dict({"goal": g, "split": split}) for g in SPLITS[split][:limit]]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        goal = row["goal"]
        if not isinstance(goal, int) or isinstance(goal, bool) or goal == 0:
            raise ValueError(f"goal must be a non-zero integer, got {goal!r}")
        return Task(env="walk", task_id=f"walk{goal:+d}", split=row.get("split", "test"),
                    instruction=f"Walk from 0 to {goal}.", data={"goal": goal})
