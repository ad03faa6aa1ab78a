"""walk: an env plugin for omrl-search. Reach a goal on a number line with `left` / `right`.

The whole state is the plain value ``(position, goal, steps, note)``, so :class:`ValueSnapshots`
gives the snapshots (``position()`` leaves the note out of the state key); ``expert_action``
lets ``scripted:oracle`` policies solve it, and ``tasks(split)`` gives disjoint train and test
goals. It passes the shared env property test (tests/test_env_contract.py): a malformed action
is an ``Invalid action:`` observation that changes nothing, the step limit truncates, and
stepping before ``reset`` is an :class:`EnvError`. Installed with this folder's pyproject.toml,
``omrl search --env walk`` finds it through the ``omrl_search.envs`` entry point.
"""
from __future__ import annotations

from typing import Any

from omrl_search.env import Env, EnvError, ValueSnapshots
from omrl_search.types import StepResult, Task

SPLITS = {"train": tuple(g for g in range(-9, 10) if g and g % 2 == 0),
          "test": tuple(g for g in range(-21, 22) if g % 2)}
MOVES = {"left": -1, "right": 1}


class WalkEnv(ValueSnapshots, Env):
    name = "walk"
    description = "Walk along a number line from 0 to the goal."
    action_help = "Actions: `left` or `right` (one step along the line)."
    max_steps = 30

    def reset(self, task: Task) -> str:
        self.state = (0, int(task.data["goal"]), 0, "")
        return self.observe()

    def position(self) -> tuple[int, int, int]:
        return self.state[:3]

    def observe(self) -> str:
        pos, goal, _, note = self.state
        return f"{note}You are at {pos}. The goal is at {goal}."

    def step(self, action: str) -> StepResult:
        """Every action, valid or not, spends one of ``max_steps``; the last one truncates."""
        if getattr(self, "state", None) is None:
            raise EnvError("step() before reset()")
        pos, goal, steps, _ = self.state
        won, over = pos == goal, steps >= self.max_steps
        if won or over:
            self.state = (pos, goal, steps, "Invalid action: the episode is over.\n")
            return StepResult(self.observe(), terminated=won, truncated=not won, success=won,
                              valid=False)
        move = MOVES.get(action.strip().lower())
        note = "" if move else f"Invalid action: {action!r}. {self.action_help}\n"
        pos, steps = pos + (move or 0), steps + 1
        self.state = (pos, goal, steps, note)
        won = pos == goal
        return StepResult(self.observe(), reward=float(won), terminated=won,
                          truncated=not won and steps >= self.max_steps, success=won,
                          valid=move is not None, info={"answer": str(pos)} if won else {})

    def valid_actions(self) -> list[str]:
        return list(MOVES)

    def expert_action(self) -> str | None:
        pos, goal = self.state[:2]
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
