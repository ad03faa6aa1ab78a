"""TextWorld games for the ``household`` env: quest specs, a disk cache of built games, and a
running game whose whole state can be saved and loaded natively.

Games come from TextWorld's own challenges (``tw-treasure_hunter`` and ``tw-cooking``), made from
a seed with :mod:`textworld.challenges` and compiled to a Z-machine file (``.z8`` plus the
``.json`` TextWorld needs for state tracking). Each is built once into
``$OMRL_CACHE/household/textworld-<version>/`` (default ``~/.cache/omrl-search/...``) and reused.

A :class:`RunningGame` wraps ``textworld.start``: TextWorld runs the game on Jericho's Z-machine
and tracks the game's logic state beside it (``StateTracking``: admissible commands, the winning
policy recomputed after every command, the quest progression). A save holds Jericho's
``get_state()`` and that wrapper's tracked fields; the progression (the only mutable part) is
shared with the save and copied just before the next command changes it (copy-on-write).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from typing import Any, NamedTuple

from omrl_search.cache import cache_root

from ._optional import require

# Our quest levels, smallest first: level -> (the TextWorld challenge's settings, step limit).
TREASURE = {  # tw-treasure_hunter levels: 5 rooms (1-10) or 10 rooms with doors and containers
    1: ({"level": 3}, 10), 2: ({"level": 5}, 12), 3: ({"level": 8}, 16),
    4: ({"level": 11}, 16), 5: ({"level": 13}, 20),
}
COOKING = {  # tw-cooking skills: ingredients in the recipe, rooms, what must be opened/cut/cooked
    1: ({"recipe": 1, "take": 1, "go": 1}, 12),
    2: ({"recipe": 1, "take": 1, "go": 1, "open": True, "cut": True}, 16),
    3: ({"recipe": 1, "take": 1, "go": 6, "open": True}, 24),
    4: ({"recipe": 2, "take": 2, "go": 6, "open": True, "cut": True}, 32),
    5: ({"recipe": 2, "take": 2, "go": 6, "open": True, "cook": True, "cut": True}, 40),
}
QUESTS = {"treasure": TREASURE, "cooking": COOKING}
LEVELS = range(1, 6)  # every quest has these levels
JERICHO_SEED = 1  # the Z-machine's RNG seed (Jericho takes 0 as "random")


class GameSpec(NamedTuple):
    """One generated game: quest kind, our level, TextWorld seed and the food split (cooking)."""

    quest: str
    level: int
    seed: int
    split: str

    @property
    def game_id(self) -> str:
        return f"{self.quest}{self.level}-{self.split}-s{self.seed}"

    @property
    def file_stem(self) -> str:
        """The cached game's file name: the TextWorld settings themselves, not our level number."""
        settings = QUESTS[self.quest][self.level][0]
        code = "+".join(f"{k}{'' if v is True else v}" for k, v in sorted(settings.items()))
        return f"{self.quest}-{code}-{self.split}-s{self.seed}"

    @property
    def step_limit(self) -> int:
        return QUESTS[self.quest][self.level][1]


def cache_dir() -> str:
    """Where built games live; the TextWorld version is part of the path (games differ by version)."""
    textworld = require("textworld", "household")
    return os.path.join(cache_root(), "household", f"textworld-{textworld.__version__}")


def game_file(spec: GameSpec) -> str:
    """The ``.z8`` file of ``spec``, built on first use (a few seconds) and cached on disk."""
    folder = cache_dir()
    path = os.path.join(folder, spec.file_stem + ".z8")
    if not os.path.isfile(path):
        build(spec, folder)
    return path


def build(spec: GameSpec, folder: str) -> None:
    """Generate and compile ``spec`` into a temporary folder, then move the files into ``folder``
    (the ``.json`` first, the ``.z8`` last, each atomically: a present ``.z8`` is a whole game;
    two processes building the same game write identical files)."""
    require("textworld", "household")
    from textworld.challenges.tw_cooking import cooking
    from textworld.challenges.tw_treasure_hunter import treasure_hunter
    from textworld.generator import compile_game
    from textworld.generator.game import GameOptions

    settings = dict(QUESTS[spec.quest][spec.level][0])
    options = GameOptions()
    options.seeds = spec.seed
    if spec.quest == "cooking":  # a recipe drawn from the seed, from the split's foods
        settings.update(recipe_seed=spec.seed + 1, split=spec.split)
        game = cooking.make(settings, options)
    else:
        game = treasure_hunter.make(settings, options)
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder, prefix=".build-")
    try:
        options.path = os.path.join(tmp, spec.file_stem + ".z8")
        options.force_recompile = True
        with warnings.catch_warnings():  # Jericho, when TextWorld replays the walkthrough
            warnings.simplefilter("ignore")
            compile_game(game, options)
        for ext in (".json", ".z8"):
            name = spec.file_stem + ext
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the game's text ----------------------------------------------------------------------------
_ART = re.compile(r"^[\s_|$\\/<>-]*$")  # lines of the ASCII-art banner
_PROMPT = re.compile(r"\n>[^\n]*$")  # the input prompt and the status line the game prints after it
_REPLAY = re.compile(r"\s*Would you like to RESTART.*$", re.DOTALL)


def clean(text: str) -> str:
    """The game's output without its banner, prompt, status line and runs of blank lines."""
    text = _REPLAY.sub("", _PROMPT.sub("", text.rstrip()))
    lines = [line.strip() for line in text.splitlines() if line.strip() == "" or not _ART.match(line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# --- a running game ----------------------------------------------------------------------------
def copy_progression(gp: Any) -> Any:
    """A copy of a TextWorld ``GameProgression`` that the copy's updates cannot affect.

    ``GameProgression.copy()`` recomputes the valid actions and rebuilds every quest's dependency
    tree only to replace them (~3 ms on a small cooking game); the progression's updates mutate
    only its logic state and its events' trees (everything else is reassigned), so copying those
    two is enough (~0.1 ms).
    """

    def clone(obj: Any, **changes: Any) -> Any:
        new = object.__new__(type(obj))
        new.__dict__.update(obj.__dict__, **changes)
        return new

    def event(ep: Any) -> Any:
        return clone(ep, _tree=ep._tree.copy())

    quests = [clone(qp, win_events=[event(e) for e in qp.win_events],
                    fail_events=[event(e) for e in qp.fail_events])
              for qp in gp.quest_progressions]
    return clone(gp, state=gp.state.copy(), quest_progressions=quests)


class RunningGame:
    """One TextWorld game in play, with native save/load of its whole state."""

    INFOS = ("admissible_commands", "policy_commands", "won", "lost", "score", "max_score")

    def __init__(self, path: str):
        textworld = require("textworld", "household")
        from textworld.envs.wrappers.tw_inform7 import Inform7Data, StateTracking

        self.path = path
        infos = textworld.EnvInfos(**dict.fromkeys(self.INFOS, True))
        with warnings.catch_warnings():  # Jericho: "not fully supported" (TextWorld tracks it)
            warnings.simplefilter("ignore")
            self.env = textworld.start(path, infos)
        self.env.seed(JERICHO_SEED)
        layer = self.env
        while not isinstance(layer, StateTracking):
            layer = layer._wrapped_env
        self.tracker = layer
        while not isinstance(layer, Inform7Data):
            layer = layer._wrapped_env
        self.inform7 = layer
        self.zmachine = self.env.unwrapped._jericho
        self.shared = False  # whether the progression belongs to a save too
        self.initial = (self.env.reset(), self.save())

    def reset(self) -> Any:
        """Back to the start (by loading the save taken right after the first reset)."""
        state, save = self.initial
        self.load(save)
        return state

    def step(self, command: str) -> Any:
        if self.shared:
            self.tracker._game_progression = copy_progression(self.tracker._game_progression)
            self.shared = False
        state, _, _ = self.env.step(command)
        return state

    def save(self) -> tuple:
        t = self.tracker
        self.shared = True
        return (self.zmachine.get_state(), t._game_progression, t._last_action,
                t._previous_winning_policy, t._current_winning_policy, t._moves, self.inform7.state)

    def load(self, save: tuple) -> None:
        t = self.tracker
        self.zmachine.set_state(save[0])
        (t._game_progression, t._last_action, t._previous_winning_policy,
         t._current_winning_policy, t._moves, self.inform7.state) = save[1:]
        t.state = self.inform7.state
        self.shared = True

    def ram(self) -> bytes:
        """The Z-machine's memory (the game's whole state, for state keys)."""
        return self.zmachine.get_state()[0].tobytes()

    def close(self) -> None:
        self.env.close()
