"""Shared pieces of the tool-action envs (``sql``, ``kgqa``, ``tools``).

* the action syntax ``verb: arguments`` (or ``verb(arguments)``; a bare ``verb`` when it takes
  none), read by :func:`parse_action`; anything else is an invalid action, never a guess (so
  ``answer (`` or ``answer foo`` without the colon is refused instead of graded);
* :class:`ActionEnv`, the episode bookkeeping they share: step count and limit, the end of the
  episode, the last message, invalid-action observations and the state key;
* :class:`SeededTasks`, task lists made from numbered seeds (one database, graph or calendar
  each) whose split a stable hash of the seed picks, so train and test never share one;
* :func:`norm_cell` and :func:`split_values`, how final answers are compared (case, spacing and
  number formatting do not matter).
"""
from __future__ import annotations

import math
import re
import threading
from typing import Any, Callable, ClassVar, NamedTuple

from omrl_search.constrain import literal
from omrl_search.env import stable_hash
from omrl_search.types import StepResult, Task

from ._text_env import TextEnv, episode_over, say, step_result, trying

_ACTION_RE = re.compile(r"^([a-z_]+)\s*(?::(.*)|\((.*)\)|[.!]?)$", re.IGNORECASE | re.DOTALL)


class ActionError(ValueError):
    """A malformed action; the message says what was wrong (shown after ``Invalid action:``)."""


class Outcome(NamedTuple):
    """What one action did: the message to show, whether it was valid, the state fields it
    changes, and ``(success, answer)`` when it ends the episode."""

    text: str
    valid: bool = True
    changes: dict[str, Any] | None = None
    final: tuple[bool, str] | None = None


def parse_action(action: str, verbs: dict[str, str]) -> tuple[str, str]:
    """``(verb, argument text)`` of an action; ``verbs`` maps each verb to its usage, and a
    usage with a colon (``sql: STATEMENT``) means the verb needs an argument."""
    text = action.strip().strip("`").strip()
    if not text:
        raise ActionError("empty action")
    m = _ACTION_RE.match(text)
    if m is None:
        raise ActionError(f"cannot parse {text[:60]!r}; write `verb: arguments`")
    verb = m.group(1).lower()
    arg = (m.group(2) if m.group(2) is not None else m.group(3) or "").strip()
    if verb not in verbs:
        raise ActionError(f"unknown action {verb!r} (known: {', '.join(verbs)})")
    if ":" in verbs[verb] and not arg:
        raise ActionError(f"{verb} needs an argument: `{verbs[verb]}`")
    if ":" not in verbs[verb] and arg:
        raise ActionError(f"{verb} takes no argument: `{verbs[verb]}`")
    return verb, arg


def split_args(arg: str, least: int, most: int, usage: str) -> list[str]:
    """The comma-separated arguments of an action (the last one keeps any further commas)."""
    parts = [p.strip() for p in arg.split(",", most - 1)]
    if len(parts) < least or not all(parts):
        raise ActionError(f"expected {least if least == most else f'{least} to {most}'} "
                          f"comma-separated arguments: `{usage}`")
    return parts


def norm_cell(value: Any) -> str:
    """A value as answers are compared: numbers to at most 2 decimals, text lower-cased with
    spacing and surrounding quotes removed, NULL as ``null``."""
    if value is None:
        return "null"
    text = str(value).strip().strip("'\"").strip()
    try:
        number = float(text)
    except ValueError:
        return " ".join(text.lower().split())
    if not math.isfinite(number):
        return text.lower()
    out = f"{number:.2f}".rstrip("0").rstrip(".")
    return "0" if out == "-0" else out


def split_values(text: str) -> list[list[str]]:
    """An answer as rows of normalised cells: rows separated by ``;`` or new lines, cells by
    ``,`` or ``|``."""
    rows = [r for r in re.split(r"[;\n]", text) if r.strip()]
    return [[norm_cell(c) for c in re.split(r"[,|]", r)] for r in rows]


class ActionEnv(TextEnv):
    """Base of the envs driven by ``verb: arguments`` actions.

    ``self.state`` is a NamedTuple with (at least) the fields ``spec`` (the task, static and
    shared between states: it has a ``key``), ``steps``, ``limit``, ``done``, ``truncated``,
    ``success``, ``answer`` and ``note`` (the message of the last action). A subclass lists its ``verbs``
    and implements ``do_<verb>(arg) -> Outcome``, which must not change ``self.state`` itself.
    """

    verbs: ClassVar[dict[str, str]] = {}
    #: verb -> wordings of why the expert takes it; fields ``{arg}`` (the argument text) and
    #: ``{a0}``, ``{a1}``... (its comma-separated parts)
    reasons: ClassVar[dict[str, tuple[str, ...]]] = {}

    def step(self, action: str) -> StepResult:
        s = self._require()
        if s.done:
            return episode_over(s)
        try:
            verb, arg = parse_action(action, self.verbs)
            out = getattr(self, f"do_{verb}")(arg)
        except ActionError as exc:
            out = Outcome(self.invalid_note(str(exc)), valid=False)
        steps = s.steps + 1
        success, answer = out.final or (False, "")
        done, note = out.final is not None, out.text
        truncated = not done and steps >= s.limit
        if truncated:
            done = True
            note += f"\nOut of steps ({s.limit}); the task is not finished."
        self.state = s._replace(steps=steps, done=done, truncated=truncated, success=success,
                                answer=answer, note=note, **(out.changes or {}))
        return step_result(self.state, self.observe(), 1.0 if success else 0.0, valid=out.valid)

    def verbs_now(self) -> dict[str, str]:
        """The verbs that can apply in the current state (default: all of ``verbs``)."""
        return self.verbs

    def action_grammar(self) -> str | None:
        """The ``verb: arguments`` format (arguments: one line not starting with a space) over
        :meth:`verbs_now`; None once the episode is over."""
        if self._require().done:
            return None
        alts = [f"{literal(v + ': ')} arg" if ":" in usage else literal(v)
                for v, usage in self.verbs_now().items()]
        return f"action ::= {' | '.join(alts)}\narg ::= [^ \\n] [^\\n]*"

    def explain(self, action: str, rng=None) -> str | None:
        """The expert's action worded by its verb's :attr:`reasons`; another action, neutrally."""
        s = self._require()
        if s.done:
            return None
        try:
            verb, arg = parse_action(action, self.verbs)
        except ActionError:
            return None
        templates = self.reasons_for(verb, arg)
        if action.strip() != self.expert_action() or not templates:
            return trying(action, rng)
        parts = {f"a{i}": p.strip() for i, p in enumerate(arg.split(","))}
        try:
            return say(rng, templates, arg=arg, **parts)
        except (KeyError, IndexError):  # an argument with fewer parts than the wording names
            return trying(action, rng)

    def reasons_for(self, verb: str, arg: str) -> tuple[str, ...]:
        """The wordings for ``verb`` (an env may pick by the argument); empty when none."""
        return self.reasons.get(verb, ())

    def observe(self) -> str:
        s = self._require()
        if s.done:
            return s.note
        left = s.limit - s.steps
        return f"{s.note}\n({left} step{'' if left == 1 else 's'} left)"

    def position(self) -> Any:
        """The state with the task replaced by its key (the last message stays: it is what the
        agent learned from its last action, so siblings that learned different things differ)."""
        return self.state._replace(spec=self.state.spec.key)

    def state_key(self) -> str:
        self._require()
        return stable_hash(self.position())


class SeededTasks:
    """Tasks made from numbered seeds, generated lazily and always in the same order.

    ``make(seed, split)`` returns the tasks of one seed (a database, graph or calendar with its
    questions; possibly none). A stable hash of ``(env, seed)`` puts ``test_percent`` of the
    seeds in the test split, so the two splits never share a seed.
    """

    def __init__(self, env: str, make: Callable[[int, str], list[Task]], sizes: dict[str, int],
                 test_percent: int = 20):
        self.env, self.make, self.sizes, self.test_percent = env, make, sizes, test_percent
        self._found: dict[str, list[Task]] = {s: [] for s in sizes}
        self._cursor = dict.fromkeys(sizes, 0)
        self._lock = threading.Lock()

    def split_of(self, seed: int) -> str:
        return "test" if int(stable_hash((self.env, seed)), 16) % 100 < self.test_percent else "train"

    def take(self, split: str, limit: int | None = None) -> list[Task]:
        if split not in self.sizes:
            raise ValueError(f"{self.env} has splits {' and '.join(map(repr, self.sizes))}, not {split!r}")
        count = self.sizes[split] if limit is None else min(limit, self.sizes[split])
        with self._lock:
            found = self._found[split]
            while len(found) < count:
                seed = self._cursor[split]
                self._cursor[split] += 1
                if self.split_of(seed) == split:
                    found.extend(self.make(seed, split))
            return found[:count]


def task_id_of(row: dict[str, Any], default: str) -> str:
    """The ``task_id`` of a user task row (a string), or ``default``."""
    task_id = row.get("task_id", default)
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"task_id must be a non-empty string, got {task_id!r}")
    return task_id


def text_field(row: dict[str, Any], key: str) -> str:
    """A required non-empty string field of a user task row."""
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value.strip()
