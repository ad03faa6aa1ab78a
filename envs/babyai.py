"""BabyAI (minigrid) grid worlds as text: follow a mission like "pick up the red ball".

Six levels of growing difficulty, from one room without distractors to unlocking a door and
putting an object next to another. The agent sees what minigrid's egocentric 7x7 view shows,
rendered as text with named objects and relative positions, and acts with primitive text actions
(``turn left``, ``move forward``, ``pick up``, ``toggle``...) or planned ones (``go to red ball
1``, ``pick up red ball 1``, ``toggle and go through blue door 1``), see :mod:`envs._babyai_text`.

The expert is minigrid's ``BabyAIBot`` in advising mode: it is told every primitive action taken
(ours or anyone's) and replans from there, so it works from any reachable state; its primitive
suggestions are our primitive text actions. Tasks are (level, seed) pairs; train and test use
disjoint seed ranges. Reward is 1 when the mission is completed.

Snapshots are native: a deep copy of the unwrapped minigrid env (grid, agent, RNG, the mission's
verifier) together with the bot, taken copy-on-write (a snapshot shares the live objects, and the
next step copies them first); walls and the spaces, which never change, are shared by every copy.
"""
from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from omrl_search.env import NativeSnapshots, register_env, stable_hash
from omrl_search.types import StepResult, Task

from . import _babyai_text as text
from ._optional import require
from ._text_env import Episode, TextEnv, episode_over, say, step_result, take_split, trying

LEVELS = {  # gymnasium id -> step limit (text actions); the bot needs at most 14-25 primitive steps
    "BabyAI-GoToRedBallNoDists-v0": 20,
    "BabyAI-GoToLocal-v0": 20,
    "BabyAI-PickupLoc-v0": 24,
    "BabyAI-OpenDoor-v0": 24,
    "BabyAI-UnlockLocal-v0": 40,
    "BabyAI-PutNextLocal-v0": 40,
}
SPLIT_ROUNDS = {"train": 50, "test": 10}  # seeds per level: 300 train and 60 test tasks
SPLIT_SEED = {"train": 0, "test": 1_000_000}  # first seed of each split (ranges never overlap)
_REASONS = ("The mission is to {mission}; next I {action}.", "To {mission}, I {action} now.",
            "{action} is the next step toward the mission: {mission}.")
_NOTES = {text.LEFT: "You turn left.", text.RIGHT: "You turn right."}


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn(Episode):
    """What the env shows and knows after a step: the episode, the view and the bot's advice."""

    view: text.View
    expert: str | None  # the bot's next action, as text


@register_env("babyai")
class BabyAIEnv(NativeSnapshots, TextEnv):
    """A BabyAI level in text: reach, pick up, open or place objects as the mission says."""

    description = ("BabyAI grid worlds in text: an agent in rooms with balls, boxes, keys and "
                   "doors follows a mission such as 'pick up the red ball'.")
    action_help = (
        "Actions: `turn left`, `turn right`, `move forward`, `pick up` (what is in front), "
        "`drop`, `toggle` (open the door in front), or one of the planned actions listed "
        "under 'Available actions', e.g. `go to red ball 1`, `pick up red ball 1`, "
        "`go through blue door 1`, `toggle and go through blue door 1`."
    )
    examples = "Think: The mission wants the red ball and I can see red ball 1.\nAct: pick up red ball 1"
    max_steps = 40

    def __init__(self) -> None:
        self._sim: tuple[Any, Any] | None = None  # (unwrapped minigrid env, its BabyAIBot or None)
        self._shared = False  # whether ``_sim`` also belongs to a snapshot (copy before changing)
        self.state: Turn | None = None
        self._key: str | None = None  # state_key() of the current state, once computed

    # --- episode -----------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        level, seed = task.data["level"], task.data["seed"]
        env = _make(level, seed)
        bot = require("minigrid.utils.baby_ai_bot", "babyai").BabyAIBot(env)
        self._sim, self._shared = (env, bot), False
        expert = self._advise(None)
        limit = task.data.get("max_steps") or LEVELS.get(level, self.max_steps)
        self.state, self._key = self._read("", expert, steps=0, limit=limit), None
        return self.observe()

    def step(self, action: str) -> StepResult:
        turn = self._require()
        if turn.done:
            return episode_over(turn)
        act = text.parse(action)
        plan = turn.view.plans.get(act) or ((text.PRIMITIVES[act],) if act in text.PRIMITIVES else None)
        if plan is None:
            note = self.invalid_note(text.why_not(act, turn.view))
            turn = turn._replace(steps=turn.steps + 1,
                                 observation=f"{note}\n{text.describe(turn.view)}")
        else:
            status, expert, note = self._run(act, plan, turn)
            turn = self._read(note, expert, turn.steps + 1, turn.limit, status)
        turn = turn.at_limit(f"Out of steps ({turn.limit}); the mission is not completed.")
        self.state, self._key = turn, None
        return step_result(turn, turn.observation, 1.0 if turn.success else 0.0, valid=plan is not None)

    def valid_actions(self) -> list[str]:
        turn = self._require()
        return [] if turn.done else list(turn.view.plans)

    def expert_action(self) -> str | None:
        turn = self._require()
        return None if turn.done else turn.expert

    def explain(self, action: str, rng=None) -> str | None:
        """The mission and the bot's next step toward it (another action: a neutral line)."""
        turn = self._require()
        if turn.done:
            return None
        if text.parse(action) != turn.expert:
            return trying(action, rng)
        return say(rng, _REASONS, mission=self._sim[0].mission, action=turn.expert)

    def state_key(self) -> str:
        if self._key is None:
            turn = self._require()
            env = self._sim[0]
            held = env.carrying.encode() if env.carrying else None
            things = tuple((k, o.encode()) for k, o in enumerate(env.grid.grid)
                           if o is not None and o.type != "wall")  # walls never change
            self._key = stable_hash((env.mission, things, tuple(map(int, env.agent_pos)),
                                     int(env.agent_dir), held, env.step_count, turn.observation,
                                     turn.steps, turn.done))
        return self._key

    # --- snapshots ---------------------------------------------------------------------------
    def save_native(self) -> Any:
        turn = self._require()
        self._shared = True
        return (self._sim, turn)

    def load_native(self, payload: Any) -> None:
        self._sim, self.state = payload
        self._shared, self._key = True, None

    def close(self) -> None:
        self._sim = self.state = self._key = None

    # --- helpers -----------------------------------------------------------------------------
    def _run(self, act: str, plan: tuple[int, ...], turn: Turn) -> tuple[str, str | None, str]:
        """Execute ``plan``'s primitive actions, telling the bot each one: (status, expert, note)."""
        if self._shared:
            self._sim, self._shared = _copy_sim(self._sim), False
        env = self._sim[0]
        before = (tuple(env.agent_pos), env.carrying, _front(env))
        status, expert = "", turn.expert
        for primitive in plan:
            _, reward, terminated, truncated, _ = env.step(primitive)
            expert = self._advise(primitive)
            if terminated or truncated:
                status = "success" if terminated and reward > 0 else "failure" if terminated else "timeout"
                break
        return status, expert, _note(act, plan, before, env)

    def _advise(self, taken: int | None) -> str | None:
        """Tell the bot the primitive just taken; its next suggestion as text (None: no advice).
        A bot that lost track (it asserts, e.g. when a box it needed was opened) is rebuilt from
        the current state; one that cannot start from there either gives no more advice."""
        env, bot = self._sim
        suggestion = None
        if bot is not None:
            try:
                suggestion = bot.replan(taken)
            except Exception:  # noqa: BLE001 - the bot's own assertions
                try:
                    bot = require("minigrid.utils.baby_ai_bot", "babyai").BabyAIBot(env)
                    suggestion = bot.replan()
                except Exception:  # noqa: BLE001
                    bot = None
        self._sim = (env, bot)
        return None if suggestion is None else text.PRIMITIVE_TEXT.get(int(suggestion))

    def _read(self, note: str, expert: str | None, steps: int, limit: int, status: str = "") -> Turn:
        env = self._sim[0]
        view = text.see(env)
        if status:  # the level ended: solved, failed, or cut by minigrid's own step limit
            end = {"success": "You completed the mission!", "failure": "The mission failed.",
                   "timeout": "Out of time; the mission is not completed."}[status]
            return Turn(observation=f"{note}\n{end}".strip(), view=view, expert=None, steps=steps,
                        limit=limit, done=True, truncated=status == "timeout",
                        success=status == "success",
                        answer="completed" if status == "success" else "failed")
        body = text.describe(view)
        return Turn(observation=f"{note}\n{body}" if note else body, view=view, expert=expert,
                    steps=steps, limit=limit)

    # --- task sets ---------------------------------------------------------------------------
    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        return take_split(split, limit, SPLIT_ROUNDS, _split_tasks)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """``{"level": "BabyAI-GoToLocal-v0", "seed": 7}``; optional ``task_id``, ``split``,
        ``max_steps``. Any registered BabyAI level works (the bot cannot solve a few)."""
        level, seed = row.get("level"), row.get("seed")
        if not isinstance(level, str) or not level.startswith("BabyAI-"):
            raise ValueError(f"level must be a BabyAI level id like 'BabyAI-GoToLocal-v0', got {level!r}")
        gym = _gym()
        if level not in gym.registry:
            raise ValueError(f"unknown BabyAI level {level!r}")
        if type(seed) is not int or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        limit = row.get("max_steps", LEVELS.get(level, cls.max_steps))
        if type(limit) is not int or not 1 <= limit <= 200:
            raise ValueError(f"max_steps must be an integer from 1 to 200, got {limit!r}")
        split = row.get("split", "test")
        if split not in SPLIT_ROUNDS:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        task = make_task(level, seed, split)
        task.data["max_steps"] = limit
        if "task_id" in row:
            task.task_id = str(row["task_id"])
        return task


def make_task(level: str, seed: int, split: str) -> Task:
    """A task; its instruction is the level's mission for that seed (one reset, ~1-8 ms)."""
    short = level.removeprefix("BabyAI-").removesuffix("-v0")
    return Task("babyai", f"babyai-{short}-{split}-s{seed}", split, seed, _make(level, seed).mission,
                {"level": level, "seed": seed})


@lru_cache(maxsize=None)
def _split_tasks(split: str) -> tuple[Task, ...]:
    """Every level once per round (easiest first); every task has its own seed."""
    return tuple(make_task(level, SPLIT_SEED[split] + r * len(LEVELS) + i, split)
                 for r in range(SPLIT_ROUNDS[split]) for i, level in enumerate(LEVELS))


def _gym() -> Any:
    gym = require("gymnasium", "babyai")
    require("minigrid", "babyai")  # registers the BabyAI levels with gymnasium
    return gym


def _make(level: str, seed: int) -> Any:
    """A fresh unwrapped env of ``level`` reset with ``seed`` (level generation prints its
    rejected samples; they are swallowed)."""
    env = _gym().make(level).unwrapped
    with contextlib.redirect_stdout(io.StringIO()):
        env.reset(seed=seed)
    return env


def _copy_sim(sim: tuple[Any, Any]) -> tuple[Any, Any]:
    """A deep copy of (env, bot); walls and the gym spaces never change, so copies share them
    (4x cheaper than a plain ``deepcopy``)."""
    env = sim[0]
    memo = {id(o): o for o in env.grid.grid if o is not None and o.type == "wall"}
    for attr in ("observation_space", "action_space", "spec"):
        value = getattr(env, attr, None)
        if value is not None:
            memo[id(value)] = value
    return copy.deepcopy(sim, memo)


def _front(env: Any) -> Any:
    cell = env.grid.get(*env.front_pos)
    return (cell.type, cell.color, getattr(cell, "is_open", None)) if cell is not None else None


def _note(act: str, plan: tuple[int, ...], before: tuple, env: Any) -> str:
    """One sentence saying what the action did."""
    pos, held, front = before
    if len(plan) == 1 and plan[0] in _NOTES:
        return _NOTES[plan[0]]
    if act == "move forward":
        return "You move forward." if tuple(env.agent_pos) != pos else "You cannot move forward."
    if act == "pick up":
        return (f"You pick up the {env.carrying.color} {env.carrying.type}." if env.carrying is not held
                else "There is nothing you can pick up in front of you.")
    if act == "drop":
        return f"You drop the {held.color} {held.type}." if held and not env.carrying \
            else "You cannot drop anything here."
    if act == "toggle":
        after = _front(env)
        if front is None or after == front:
            return "Nothing happens."
        kind, color, _ = front
        if kind == "door":
            return f"You {'open' if after[2] else 'close'} the {color} door."
        return f"You open the {color} {kind}."
    return f"You {act}."
