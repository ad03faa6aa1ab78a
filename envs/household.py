"""Household text games (TextWorld): find an object, or cook and eat a meal from a recipe.

Games are TextWorld's ``tw-treasure_hunter`` and ``tw-cooking`` challenges generated from a seed
at five levels each (rooms, quest length, containers, cutting and cooking grow with the level),
built once and cached on disk (:mod:`envs._textworld_games`). Train and test use disjoint seed
ranges (cooking games also draw their foods from TextWorld's own train/test food split).

The first observation is the game's introduction (its objective and the first room); every
observation lists the commands TextWorld admits in that state, and only those are played (others
are invalid actions that leave the game untouched). The expert is the game's walkthrough as
TextWorld recomputes it after every command from the current state. Reward is 1 when the game is
won; a lost game (e.g. taking the wrong object, eating an ingredient) ends the episode.

Snapshots are native: the Z-machine's state (Jericho ``get_state``) plus TextWorld's tracked
logic state, shared copy-on-write (see :class:`envs._textworld_games.RunningGame`).
"""
from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from omrl_search.env import NativeSnapshots, register_env, stable_hash
from omrl_search.types import StepResult, Task

from . import _textworld_games as tw
from ._optional import check, require
from ._text_env import Episode, TextEnv, episode_over, say, step_result, take_split, trying

SPLIT_ROUNDS = {"train": 40, "test": 2}  # seeds per (quest, level): 400 train and 20 test games
SPLIT_SEED = {"train": 0, "test": 100_000}  # first seed of each split (ranges never overlap)
OPEN_GAMES = 32  # games one env instance keeps started (~2 MB each; switching between them is free)
_ALIASES = {"n": "go north", "s": "go south", "e": "go east", "w": "go west", "i": "inventory",
            "l": "look", "north": "go north", "south": "go south", "east": "go east",
            "west": "go west"}
_INSTRUCTIONS = {
    "treasure": ("Treasure hunt in a house of {rooms} rooms: the objective in the first observation "
                 "names an object; find it and take it. Taking any other object loses the game."),
    "cooking": ("Cooking game ({recipe} ingredient{s}, {rooms} room{rs}): find the kitchen, read "
                "the recipe in the cookbook, gather and prepare its ingredients as it says, then "
                "prepare the meal and eat it. Eating or spoiling an ingredient loses the game."),
}


_REASONS = ("{left} command{s} from winning; the next one is to {action}.",
            "The quest goes on with: {action} ({left} step{s} to go).",
            "Next on the way to winning: {action}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn(Episode):
    """What the env shows and knows after a step: the episode and TextWorld's game state."""

    admissible: tuple[str, ...]
    policy: tuple[str, ...]  # TextWorld's walkthrough from this state
    score: int
    max_score: int


@register_env("household")
class HouseholdEnv(NativeSnapshots, TextEnv):
    """A TextWorld game: play admissible text commands until the quest is won or lost."""

    description = ("Household text games (TextWorld): explore rooms, take and use objects, cook "
                   "a meal from a recipe or find a named object.")
    action_help = (
        "Actions: one command from the 'Available commands' list of the last observation, "
        "written exactly, e.g. `go north`, `open fridge`, `take red apple from counter`, "
        "`examine cookbook`, `slice red apple with knife`, `prepare meal`, `eat meal`."
    )
    examples = ("Think: The cookbook asks for a red apple and it is on the counter.\n"
                "Act: take red apple from counter")
    max_steps = 40

    def __init__(self) -> None:
        self._games: OrderedDict[str, tw.RunningGame] = OrderedDict()
        self._game: tw.RunningGame | None = None
        self.state: Turn | None = None
        self._key: str | None = None

    # --- episode -----------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        path, limit = _game_of(task)
        game = self._open(path)
        state = game.reset()
        self._set(game, self._read(state, steps=0, limit=limit))
        return self.observe()

    def step(self, action: str) -> StepResult:
        turn = self._require()
        if turn.done:
            return episode_over(turn)
        command = _normalize(action)
        valid = command in turn.admissible
        if valid:
            state = self._game.step(command)
            turn = self._read(state, turn.steps + 1, turn.limit)
        else:
            why = (f"{command[:80]!r} is not one of the available commands" if command
                   else "empty action")
            turn = turn._replace(steps=turn.steps + 1,
                                 observation=_show(self.invalid_note(why), turn.admissible))
        turn = turn.at_limit(f"Out of steps ({turn.limit}); the game is not won.")
        self._set(self._game, turn)
        return step_result(turn, turn.observation, 1.0 if turn.success else 0.0, valid=valid,
                           score=turn.score, max_score=turn.max_score)

    def valid_actions(self) -> list[str]:
        turn = self._require()
        return [] if turn.done else list(turn.admissible)

    def expert_action(self) -> str | None:
        turn = self._require()
        return None if turn.done or not turn.policy else turn.policy[0]

    def explain(self, action: str, rng=None) -> str | None:
        """The walkthrough's next command and how much of it is left (another action: a
        neutral line)."""
        turn = self._require()
        if turn.done:
            return None
        if not turn.policy or _normalize(action) != turn.policy[0]:
            return trying(action, rng)
        left = len(turn.policy)
        return say(rng, _REASONS, action=turn.policy[0], left=left, s="" if left == 1 else "s")

    def heuristic(self) -> float:
        """Progress: the game's score over its maximum (cooking scores each recipe step)."""
        turn = self._require()
        return 1.0 if turn.success else turn.score / max(turn.max_score, 1)

    def state_key(self) -> str:
        if self._key is None:
            turn = self._require()
            ram = hashlib.blake2b(self._game.ram(), digest_size=8).hexdigest()
            self._key = stable_hash((self._game.path, ram, turn))
        return self._key

    # --- snapshots ---------------------------------------------------------------------------
    def save_native(self) -> Any:
        turn = self._require()
        return (self._game.path, self._game.save(), turn)

    def load_native(self, payload: Any) -> None:
        path, save, turn = payload
        game = self._open(path)
        game.load(save)
        self._set(game, turn)

    def close(self) -> None:
        for game in self._games.values():
            game.close()
        self._games.clear()
        self._game = self.state = self._key = None

    # --- helpers -----------------------------------------------------------------------------
    def _set(self, game: tw.RunningGame, turn: Turn) -> None:
        self._game, self.state, self._key = game, turn, None

    def _open(self, path: str) -> tw.RunningGame:
        """The started game for ``path`` (the least recently used one is closed beyond a few)."""
        game = self._games.pop(path, None) or tw.RunningGame(path)
        self._games[path] = game
        while len(self._games) > OPEN_GAMES:
            self._games.popitem(last=False)[1].close()
        return game

    @staticmethod
    def _read(state: Any, steps: int, limit: int) -> Turn:
        """A :class:`Turn` from TextWorld's game state after a command."""
        admissible = tuple(state["admissible_commands"])
        won, lost = bool(state["won"]), bool(state["lost"])
        done = won or lost
        text = tw.clean(state.feedback) or "Nothing happens."
        return Turn(observation=_show(text, () if done else admissible), steps=steps, limit=limit,
                    done=done, success=won, answer="won" if won else "lost" if lost else "",
                    admissible=admissible, policy=tuple(state["policy_commands"] or ()),
                    score=int(state["score"] or 0), max_score=int(state["max_score"] or 0))

    # --- task sets ---------------------------------------------------------------------------
    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        check("textworld", "household")
        return take_split(split, limit, SPLIT_ROUNDS, _split_tasks)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """``{"quest": "cooking"|"treasure", "level": 1-5, "seed": int}`` (a generated game), or
        ``{"game_file": "path/game.z8"}`` (a TextWorld game with its ``.json`` beside it);
        optional ``task_id``, ``split``, ``max_steps``."""
        split = row.get("split", "test")
        if split not in SPLIT_ROUNDS:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        limit = row.get("max_steps", cls.max_steps)
        if type(limit) is not int or not 1 <= limit <= 200:
            raise ValueError(f"max_steps must be an integer from 1 to 200, got {limit!r}")
        if "game_file" in row:
            path = row["game_file"]
            if not isinstance(path, str) or not re.search(r"\.z\d$", path):
                raise ValueError(f"game_file must be the path of a .z8 game, got {path!r}")
            if not os.path.isfile(path) or not os.path.isfile(path[:-3] + ".json"):
                raise ValueError(f"game_file {path!r} and its .json must both exist")
            data = {"game_file": os.path.abspath(path), "max_steps": limit}
            task_id = row.get("task_id", "household-" + os.path.basename(path)[:-3])
            return Task("household", str(task_id), split, 0, _objective(path), data)
        quest, level, seed = row.get("quest"), row.get("level"), row.get("seed")
        if quest not in tw.QUESTS:
            raise ValueError(f"quest must be one of {sorted(tw.QUESTS)} (or give game_file), got {quest!r}")
        if level not in tw.QUESTS[quest]:
            raise ValueError(f"level must be one of {sorted(tw.QUESTS[quest])}, got {level!r}")
        if type(seed) is not int or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        task = make_task(tw.GameSpec(quest, level, seed, split))
        if "max_steps" in row:
            task.data["max_steps"] = limit
        if "task_id" in row:
            task.task_id = str(row["task_id"])
        return task


def make_task(spec: tw.GameSpec) -> Task:
    settings = tw.QUESTS[spec.quest][spec.level][0]
    rooms = settings.get("go") or (5 if settings.get("level", 1) <= 10 else 10)
    n = settings.get("recipe", 1)
    text = _INSTRUCTIONS[spec.quest].format(rooms=rooms, rs="s" * (rooms > 1), recipe=n,
                                            s="s" * (n > 1))
    data = {"quest": spec.quest, "level": spec.level, "seed": spec.seed}
    return Task("household", f"household-{spec.game_id}", spec.split, spec.seed, text, data)


@lru_cache(maxsize=None)
def _split_tasks(split: str) -> tuple[Task, ...]:
    """Smallest games first: every (level, quest) pair once per round, with a fresh seed."""
    return tuple(
        make_task(tw.GameSpec(quest, level, SPLIT_SEED[split] + r, split))
        for r in range(SPLIT_ROUNDS[split]) for level in tw.LEVELS for quest in tw.QUESTS
    )


def prebuild(split: str = "test", limit: int | None = None) -> list[str]:
    """Build (or find in the cache) the games of a split, e.g. before tests or a benchmark
    (each new game takes ~1-3 s to generate and compile); returns their files."""
    return [_game_of(task)[0] for task in HouseholdEnv.tasks(split, limit)]


def _game_of(task: Task) -> tuple[str, int]:
    """The game file of a task (built if needed) and its step limit."""
    data = task.data
    if "game_file" in data:
        return data["game_file"], data.get("max_steps", HouseholdEnv.max_steps)
    spec = tw.GameSpec(data["quest"], data["level"], data["seed"], task.split)
    limit = min(data.get("max_steps", spec.step_limit), 200)
    return tw.game_file(spec), limit


def _objective(path: str) -> str:
    """The objective stored in a TextWorld game's ``.json``."""
    game = require("textworld.generator.game", "household").Game
    return game.load(path[:-3] + ".json").objective


def _normalize(action: str) -> str:
    text = " ".join(action.lower().strip().strip("`'\"").strip().rstrip(".!").split())
    return _ALIASES.get(text, text)


def _show(text: str, admissible: tuple[str, ...]) -> str:
    return f"{text}\nAvailable commands: {', '.join(admissible)}." if admissible else text
