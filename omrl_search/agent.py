"""Agent formats: how a node's history becomes a prompt and a completion becomes an action.

A format renders turns (:meth:`ReActFormat.first_messages`, :meth:`ReActFormat.observation_message`),
parses completions (:meth:`ReActFormat.parse`) and builds one search's prompts
(:meth:`ReActFormat.prompts`, a :class:`~omrl_search.prompts.Prompts`); the engine only asks it.

The default is ReAct in the OpenManus-RL dataset format: the model answers ``Think: ...`` then
``Act: <action>``. For structured decoding the format also writes the grammar of that frame
(:meth:`ReActFormat.grammar`: its ``think`` and ``act`` literals around the env's action
language, see docs/design.md §4). A malformed completion is never an exception: :meth:`ReActFormat.parse` returns
an error text that becomes the invalid-action observation.

:class:`TurnEncoder` builds prompts as token ids turn by turn (first prompt, then for each
observation only the new tokens), so a trajectory's ids are exactly what the policy saw.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .constrain import Grammar
from .policy import ChatTokenizer
from .prompts import Prompts
from .specs import SpecError
from .types import Task

if TYPE_CHECKING:  # pragma: no cover
    from .tree import SearchTree

_ACT = re.compile(r"^\s*\**\s*(?:act|action)\s*\**\s*:\s*\**\s*", re.IGNORECASE | re.MULTILINE)
_THINK = re.compile(r"^\s*\**\s*(?:think|thought)\s*\**\s*:\s*\**\s*", re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\s*(?:observation|think|thought)\s*:", re.IGNORECASE | re.MULTILINE)


@dataclass(slots=True)
class Parsed:
    thought: str
    action: str
    error: str = ""  # non-empty when the completion is malformed


class ReActFormat:
    """``Think: ... / Act: ...`` prompting and parsing."""

    name = "react"
    stop: tuple[str, ...] = ("\nObservation:", "Observation:")
    #: the frame's literal text before the thought (None: no thought line) and before the action,
    #: as :meth:`render` writes them: what a constrained completion is made to look like
    think: str | None = "Think: "
    act: str = "\nAct: "
    #: the first prompt shows the env's action help and example turn; what separates its parts
    shows_help: bool = True
    joiner: str = "\n\n"

    def __init__(self, system: str | None = None):
        self.system = system or (
            "You are an agent that solves tasks step by step in an environment. "
            "In every turn, write one line 'Think: <your reasoning>' and then one line "
            "'Act: <one action>'. The environment answers each action with an observation."
        )

    def prompts(self, env: Any, task: Task, tree: "SearchTree",
                encoder: "TurnEncoder | None") -> Prompts:
        """What the policy is shown in one search (messages and, with ``encoder``, token ids)."""
        return Prompts(self, encoder, env, task, tree)

    def first_messages(self, env: object, task: Task, observation: str,
                       note: str = "") -> list[dict[str, str]]:
        """System and first user turn: task instruction, action syntax and example (when the
        format :attr:`shows_help`), observation, then ``note`` after a blank line."""
        parts = [f"Task: {task.instruction}".strip()]
        if self.shows_help and getattr(env, "action_help", ""):
            parts.append(env.action_help)
        if self.shows_help and getattr(env, "examples", ""):
            parts.append(f"Example turn:\n{env.examples}")
        parts.append(f"Observation: {observation}")
        text = self.joiner.join(parts)
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": f"{text}\n\n{note}" if note else text}]

    def observation_message(self, observation: str, note: str = "") -> dict[str, str]:
        text = f"Observation: {observation}"
        return {"role": "user", "content": f"{text}\n\n{note}" if note else text}

    def parse(self, completion: str, action_help: str = "") -> Parsed:
        text = completion.strip()
        act = _ACT.search(text)
        if act is None:
            return Parsed(text, "", self._error("no 'Act:' line", action_help))
        think = _THINK.search(text, 0, act.start())
        thought = text[think.end():act.start()].strip() if think else text[:act.start()].strip()
        rest = text[act.end():]
        end = _END.search(rest)
        if end is not None:
            rest = rest[:end.start()]
        action = rest.strip() if "```" in rest else rest.strip().split("\n", 1)[0].strip()
        action = action.strip("`").strip()
        if not action:
            return Parsed(thought, "", self._error("the 'Act:' line is empty", action_help))
        return Parsed(thought, action)

    #: what the invalid-format observation asks for
    answer_with = "Answer with 'Think: <reasoning>' then 'Act: <action>'."

    def _error(self, what: str, action_help: str) -> str:
        msg = f"Invalid format: {what}. {self.answer_with}"
        return f"{msg}\n{action_help}" if action_help else msg

    def render(self, thought: str, action: str) -> str:
        """The completion text this format expects for a (thought, action)."""
        return f"Think: {thought}\nAct: {action}"

    def grammar(self, kind: str, space: Any = None, source: str = "") -> Grammar:
        """The grammar of this format's frame: ``kind`` "format" (any one-line action) or
        "actions", the action being one of the list ``space`` or the language of the rules
        text ``space`` (a :class:`~omrl_search.constrain.Grammar` passes its rules)."""
        frame = {"think": self.think, "act": self.act}
        if kind == "format":
            return Grammar.any_line(source, **frame)
        if isinstance(space, Grammar):
            space = space.rules
        if isinstance(space, str):
            return Grammar.from_rules(space, source, **frame)
        return Grammar.one_of(list(space or ()), source, **frame)


class ActFormat(ReActFormat):
    """``Act: <action>`` alone, no thought line. For small models whose thoughts are noise: every
    completion token goes to the action, and a constrained step is a handful of tokens (the
    thought line is free text that an untrained 135M model runs on until ``max_tokens``)."""

    name = "act"
    think = None
    act = "Act: "
    answer_with = "Answer with one line 'Act: <action>'."

    def __init__(self, system: str | None = None):
        super().__init__(system or (
            "You are an agent that solves tasks step by step in an environment. "
            "In every turn, write one line 'Act: <one action>'. "
            "The environment answers each action with an observation."))

    def render(self, thought: str, action: str) -> str:
        return f"Act: {action}"


class TerseFormat(ActFormat):
    """The action alone is the whole completion, after a first prompt of only the task and the
    observation (a one-sentence system text, no action help, no example turn). For trained
    policies searched at a token budget: every prompt token is read again at every node a search
    expands or rolls out from, and each valid action a prior scores is read whole, so the frame's
    words cost a search its simulations (Game24: a first prompt of ~70 tokens against ``act``'s
    ~140, each scored action 3 tokens shorter). Without the help an untrained model sees no
    action syntax until a malformed step's error brings it (SmolLM2 base on Game24 did no worse
    for it: 10 against ``act``'s 8/200, docs/loop.md). A completion that writes ``Act:`` anyway
    is read as ``act`` reads it."""

    name = "terse"
    act = ""
    shows_help = False
    joiner = "\n"
    answer_with = "Answer with the action alone, on one line."

    def __init__(self, system: str | None = None):
        super().__init__(system or "Answer each observation with one action.")

    def parse(self, completion: str, action_help: str = "") -> Parsed:
        text = completion.strip()
        if _ACT.search(text) is not None:
            return super().parse(text, action_help)
        action = text.split("\n", 1)[0].strip().strip("`").strip()
        if not action:
            return Parsed("", "", self._error("the completion is empty", action_help))
        return Parsed("", action)

    def render(self, thought: str, action: str) -> str:
        return action


AGENT_FORMATS = {"react": ReActFormat, "act": ActFormat, "terse": TerseFormat}


def check_agent_name(name: str) -> str:
    """``name`` if it names an agent format (for config fields; a typo fails with the known names)."""
    make_format(name)
    return name


def make_format(name: "str | ReActFormat | None") -> ReActFormat:
    """The agent format named ``name`` (``react`` | ``act`` | ``terse``), or ``name`` itself if
    already one."""
    if name is None:
        return ReActFormat()
    if isinstance(name, ReActFormat):
        return name
    try:
        return AGENT_FORMATS[name]()
    except KeyError:
        raise SpecError(f"unknown agent format {name!r} (known: {', '.join(AGENT_FORMATS)})") from None


class TurnEncoder:
    """Token ids of the first prompt and of each later observation turn, for one tokenizer.

    The observation turn's ids are the chat template's text between the end of an assistant
    message and the next generation prompt, found once with a sentinel message; if the
    completion already ended with the end-of-turn token, that token is not added again.
    """

    SENTINEL = "\u2063omrl-sentinel\u2063"

    def __init__(self, tokenizer: ChatTokenizer):
        self.tok = tokenizer
        s = self.SENTINEL
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": s}]
        closed = tokenizer.render(base, add_generation_prompt=False)
        cut = closed.rindex(s) + len(s)
        self._close = closed[cut:]  # end-of-turn text after an assistant message
        after = tokenizer.render(base + [{"role": "user", "content": s}], add_generation_prompt=True)
        if not after.startswith(closed[:cut]):
            raise ValueError("chat template does not extend conversations by appending text")
        tail = after[cut:]
        i = tail.index(s)
        self._before_obs, self._after_obs = tail[:i], tail[i + len(s):]
        self._close_text = self._close.rstrip("\n ")
        self._close_ids = tokenizer.encode(self._close_text) if self._close_text else []

    @property
    def close_ids(self) -> list[int]:
        """The ids that end an assistant turn (e.g. ``<|im_end|>``): appended to demonstration
        completions that a policy would have ended itself."""
        return list(self._close_ids)

    def first_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tok.encode(self.tok.render(messages, add_generation_prompt=True))

    def observation_turn(self, content: str, completion_ids: Sequence[int]) -> list[int]:
        """Ids that follow an assistant completion: the end of turn (unless the completion
        already ends with it), the user turn with ``content``, and the generation prompt."""
        prefix = self._before_obs
        n = len(self._close_ids)
        if n and list(completion_ids[-n:]) == self._close_ids and prefix.startswith(self._close_text):
            prefix = prefix[len(self._close_text):]
        return self.tok.encode(prefix + content + self._after_obs)
