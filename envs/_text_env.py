"""What the bundled text envs share about an episode: its state value, its end, its step results.

Every bundled text env keeps its state as one immutable value in ``self.state`` (a NamedTuple for
the value-snapshot envs, an :class:`Episode` for the native ones) with the fields ``done``,
``truncated``, ``success`` and ``answer`` (``sciworld``, whose state is the JVM's, keeps them as
attributes of the env). From such a value:

* :func:`step_result` builds the :class:`~omrl_search.types.StepResult` of a step, with Gymnasium's
  ``terminated`` (the task reached an end state: solved, answered, won or lost) and ``truncated``
  (the episode was cut by its step limit) and the typed ``success`` and ``valid`` (see
  docs/design.md §4); ``info`` keeps the final ``answer`` and env detail;
* :func:`episode_over` is what stepping a finished episode returns: an invalid action that
  changes nothing.

:class:`TextEnv` is the base those envs share (``_require``, the invalid-action message, and the
two optional hooks below), :func:`take_split` how their ``tasks(split, limit)`` check and slice a
split, and :func:`task_knobs` how the envs with a curriculum (game24, countdown, sokoban) read
difficulty knobs from ``tasks(split, limit, **knobs)`` or from the split itself
(``--split test:level=2``).

Two optional methods serve the agent format and the demonstrations (docs/design.md §4):

* ``action_grammar()``: grammar rules defining ``action`` for the *current* state, in
  :mod:`omrl_search.constrain`'s GBNF / xgrammar-EBNF common subset, when the env's action
  language is wider than ``valid_actions()`` lists (Game24's ``answer EXPR``, SQL, shell);
  None when ``valid_actions()`` is the whole language or no syntax is known;
* ``explain(action, rng)``: one line of reasoning the action follows from in the current state
  (before stepping it), worded by one of a few templates the caller's ``rng`` picks; what the
  scripted oracle writes as its ``Think:`` line. None when the env has nothing true to say.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence, TypeVar

from omrl_search.env import Env, EnvError
from omrl_search.types import StepResult, Task

EPISODE_OVER = "Invalid action: the episode is over."
E = TypeVar("E", bound="Episode")


@dataclasses.dataclass(frozen=True, slots=True)
class Episode:
    """How an episode stands after a step (immutable, so snapshots share it); envs subclass it
    with keyword-only fields of their own (``@dataclass(frozen=True, slots=True, kw_only=True)``)."""

    observation: str
    steps: int
    limit: int
    done: bool = False
    truncated: bool = False  # ended by the step limit, not by reaching an end state
    success: bool = False
    answer: str = ""

    def _replace(self: E, **changes: Any) -> E:
        return dataclasses.replace(self, **changes)

    def at_limit(self: E, note: str, answer: str = "unfinished") -> E:
        """This state, or, when it used the last allowed step without ending, the episode cut
        there (truncated), ``note`` added to the observation."""
        if self.done or self.steps < self.limit:
            return self
        return self._replace(done=True, truncated=True, answer=answer,
                             observation=f"{self.observation}\n{note}")


def step_result(s: Any, observation: str, reward: float, *, valid: bool, **info: Any) -> StepResult:
    """The result of a step that left the episode in state ``s``; ``info`` gets ``s.answer``
    when the episode ended."""
    if s.done:
        info["answer"] = s.answer
    return StepResult(observation, reward, terminated=s.done and not s.truncated,
                      truncated=s.truncated, info=info, success=s.success, valid=valid)


def episode_over(s: Any) -> StepResult:
    """What a step after the end returns: an invalid action that changes nothing (the episode
    stays ended as it was)."""
    return step_result(s, EPISODE_OVER, 0.0, valid=False)


def take_split(split: str, limit: int | None, splits: Sequence[str],
               make: Callable[[str], Sequence[Task]]) -> list[Task]:
    """The first ``limit`` (all when None) of ``make(split)``'s tasks, once ``split`` is known
    to be one of ``splits``."""
    if split not in splits:
        raise ValueError(f"unknown split {split!r} (known: {', '.join(splits)})")
    tasks = make(split)
    return list(tasks[:limit] if limit is not None else tasks)


Range = tuple[int, int]
Choice = tuple[str, ...]  # a knob that takes one of a few words, e.g. ("on", "off")


def task_knobs(env: str, split: str, given: dict[str, Any], known: dict[str, Range | Choice],
               splits: Sequence[str] = ("train", "test")) -> tuple[str, dict[str, Any]]:
    """The split and the difficulty knobs of a ``tasks()`` call: ``split`` may carry knobs
    (``"test:level=2"``, ``"train:numbers=4,target=10-99"``: what ``--split`` gives from the
    CLI), ``given`` holds keyword knobs (they win). A numeric knob is an int or a range
    ``LO-HI`` (a string or a pair) within its bounds in ``known``, giving ``(lo, hi)``; a choice
    knob (``known`` lists its words) is one of the words, any case, giving the word. Returns
    ``(split, {knob: value})``, knobs sorted. Anything else is one ``ValueError`` line naming
    the env, the knob and what it takes."""
    base, _, spec = split.partition(":")
    if base not in splits:
        raise ValueError(f"{env} has splits {' and '.join(map(repr, splits))}, not {base!r}")
    raw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"{env}: bad task knob {part!r} in split {split!r} (expected knob=value)")
        raw[key.strip()] = value.strip()
    raw.update({k: v for k, v in given.items() if v is not None})
    out = {}
    for key, value in sorted(raw.items()):
        if key not in known:
            names = ", ".join(f"{k} ({'|'.join(b) if _is_choice(b) else '%d-%d' % b})"
                              for k, b in known.items())
            raise ValueError(f"{env}: unknown task knob {key!r} (known: {names})")
        bounds = known[key]
        out[key] = (_knob_choice(env, key, value, bounds) if _is_choice(bounds)
                    else _knob_range(env, key, value, bounds))
    return base, out


def _is_choice(bounds: Range | Choice) -> bool:
    return isinstance(bounds[0], str)


def _knob_choice(env: str, key: str, value: Any, words: Choice) -> str:
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in words:
        raise ValueError(f"{env}: task knob {key} must be {' or '.join(words)}, got {value!r}")
    return word


def _knob_range(env: str, key: str, value: Any, bounds: Range) -> Range:
    lo = hi = None
    if type(value) is int:
        lo = hi = value
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is int for v in value):
        lo, hi = value
    elif isinstance(value, str):
        a, dash, b = value.strip().partition("-")
        if a.strip().isdigit() and (not dash or b.strip().isdigit()):
            lo, hi = int(a), int(b if dash else a)
    if lo is None or not bounds[0] <= lo <= hi <= bounds[1]:
        raise ValueError(f"{env}: task knob {key} must be an integer or a range LO-HI within "
                         f"{bounds[0]}-{bounds[1]}, got {value!r}")
    return lo, hi


def knob_label(knobs: dict[str, Range]) -> str:
    """``{"level": (2, 2), "size": (6, 7)}`` -> ``"level=2,size=6-7"`` (what a split string says)."""
    return ",".join(f"{k}={lo}" if lo == hi else f"{k}={lo}-{hi}" for k, (lo, hi) in knobs.items())


class TextEnv(Env):
    """Base of the bundled text envs whose whole state is the immutable value ``self.state``."""

    state: Any = None

    def observe(self) -> str:
        """The state's ``observation`` (envs that render their state override this)."""
        return self._require().observation

    def invalid_note(self, why: str) -> str:
        """The message of a malformed or inadmissible action: what was wrong and the syntax."""
        return f"Invalid action: {why}. {self.action_help}"

    def action_grammar(self) -> str | None:
        """Rules defining ``action`` in the current state (see the module docstring); None here."""
        return None

    def explain(self, action: str, rng: random.Random | None = None) -> str | None:
        """Why ``action`` in the current state, one line (see the module docstring); None here."""
        return None

    def _require(self) -> Any:
        if self.state is None:
            raise EnvError("reset() must be called first")
        return self.state


def say(rng: random.Random | None, templates: Sequence[str], **fields: Any) -> str:
    """One of ``templates`` (chosen by ``rng``; the first without one) filled with ``fields``,
    as one line starting with a capital."""
    text = templates[rng.randrange(len(templates))] if rng is not None else templates[0]
    line = " ".join(text.format(**fields).split())
    return line[:1].upper() + line[1:]


_TRY = ("I try {action}.", "Let me try {action}.", "Next I try {action}.")


def trying(action: str, rng: random.Random | None) -> str:
    """The neutral line for an action an env has no reason for (not its expert's)."""
    return say(rng, _TRY, action=" ".join(action.split())[:120])


def listing(items: Sequence[Any]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    words = [str(x) for x in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
