"""What the policy is shown at a node: one :class:`Prompts` per search, owned by the agent format.

The engine asks for a node's step prompt (chat messages, and with a tokenizer the exact token ids)
or for a free-form ``ask`` prompt, and turns a completion into a :class:`~omrl_search.types.Step`;
how any of these look is the agent format's business (:meth:`ReActFormat.prompts` builds this
object), so a different format changes prompts without touching the engine (see docs/design.md §4).

Messages are built once per node and cached (a child's chat is its parent's plus two turns).
With a :class:`~omrl_search.agent.TurnEncoder`, a step's prompt ids are the ids recorded along the
node's path plus the new turn, copied once, never re-rendered, so a trajectory's ids are exactly
what the policy saw.

Structured decoding (see docs/design.md §4): :class:`Constraint` decides, per search and per
node, the grammar an expansion's request carries (:meth:`Prompts.grammar` writes it in the
format's frame) and counts what each generation was generated under. ``constrain`` is one of
:data:`CONSTRAIN_MODES`:

* ``none``: no grammar; ``format``: the Think/Act frame with any one-line action;
* ``actions``: the frame with the env's action language at the node's state (its
  ``action_grammar()`` rules or its ``valid_actions()`` list); an env offering neither is a
  :class:`ConstraintError`, a node where it lists no action is a fault on that node (no LM call);
* ``auto`` (default): ``actions`` where the env offers them, else ``format``; a node where the
  env lists no action falls back to ``format``, a policy that cannot constrain to ``none``, each
  recorded in the result's ``constraint`` notes. ``ask`` prompts never carry a grammar.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .constrain import Grammar, GrammarError, check, stamp
from .types import Generation, Step, Task

if TYPE_CHECKING:  # pragma: no cover
    from .agent import ReActFormat, TurnEncoder
    from .env_driver import EnvDriver
    from .tree import Node, SearchTree

#: the values of the ``constrain`` setting (Engine, search_many, ``--constrain``)
CONSTRAIN_MODES = ("auto", "none", "format", "actions")
#: the counters of a result's ``constraint`` record (see :meth:`Constraint.as_dict`)
CONSTRAINT_COUNTS = ("requests", "generations", "actions", "format", "none", "violations",
                     "partial", "fallbacks", "skipped")

Messages = list[dict[str, str]]


class Prompts:
    """One search's prompts in an agent format: step prompts per node, ask prompts, steps parsed.

    ``stop`` is the format's stop strings (used when the sampling parameters name none).
    ``chat``: build each step's chat messages; the engine turns it off for a policy that reads
    only token ids (``reads_messages = False``), whose step requests then carry no messages
    (``[]``), so neither the messages nor their per-node cache are made."""

    __slots__ = ("format", "encoder", "env", "task", "tree", "stop", "_messages", "chat")

    def __init__(self, fmt: "ReActFormat", encoder: "TurnEncoder | None", env: Any, task: Task,
                 tree: "SearchTree"):
        self.format, self.encoder, self.env, self.task, self.tree = fmt, encoder, env, task, tree
        self.stop: tuple[str, ...] = fmt.stop
        self._messages: dict[int, Messages] = {}
        self.chat = True

    def messages(self, node: "Node") -> Messages:
        """The chat up to ``node``'s observation (without notes), cached per node."""
        cached = self._messages.get(node.id)
        if cached is None:
            if node.parent is None:
                cached = self.format.first_messages(self.env, self.task, node.observation)
            else:
                cached = self.messages(self.tree.nodes[node.parent]) + [
                    {"role": "assistant", "content": node.step.completion},
                    self.format.observation_message(node.observation)]
            self._messages[node.id] = cached
        return cached

    def step(self, node: "Node", note: str = "") -> tuple[Messages, list[int] | None, list[int] | None]:
        """The prompt for a step from ``node`` (``note`` added to its last turn): messages,
        the ids this step adds (``Step.context_ids``) and the whole prompt's ids (None and None
        without a tokenizer)."""
        if not self.chat and self.encoder is not None and node.parent is not None:
            last = self.format.observation_message(node.observation, note)["content"]
            context_ids = self.encoder.observation_turn(last, node.step.completion_ids or [])
            return [], context_ids, self.prompt_ids(node, context_ids)
        messages = self.messages(node)
        if note:
            last = (self.format.first_messages(self.env, self.task, node.observation, note)[-1]
                    if node.parent is None else self.format.observation_message(node.observation, note))
            messages = messages[:-1] + [last]
        if self.encoder is None:
            return messages, None, None
        context_ids = self.context_ids(node, messages)
        prompt_ids = context_ids if node.parent is None else self.prompt_ids(node, context_ids)
        return messages, context_ids, prompt_ids

    def context_ids(self, node: "Node", messages: Messages | None = None) -> list[int] | None:
        """The prompt ids added before a step from ``node``: the whole first prompt at the root,
        else the turn that shows ``node``'s observation (the last message). None without a
        tokenizer."""
        if self.encoder is None:
            return None
        if messages is None and not self.chat and node.parent is not None:
            messages = [self.format.observation_message(node.observation)]
        if messages is None:
            messages = self.messages(node)
        if node.parent is None:
            return self.encoder.first_prompt(messages)
        return self.encoder.observation_turn(messages[-1]["content"], node.step.completion_ids or [])

    def prompt_ids(self, node: "Node", tail: list[int]) -> list[int]:
        """The exact ids the policy sees at ``node``: each step's context and completion ids
        along the path, then ``tail``, copied once into a new list (never re-rendered)."""
        parts, nodes = [tail], self.tree.nodes
        while node.parent is not None:
            step = node.step
            parts += (step.completion_ids or (), step.context_ids or ())
            node = nodes[node.parent]
        out: list[int] = []
        for part in reversed(parts):
            out += part
        return out

    def ask(self, prompt: "str | Messages") -> tuple[Messages, list[int] | None]:
        """A free-form prompt (a string is one user turn) and its ids (None without a tokenizer)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return messages, (self.encoder.first_prompt(messages) if self.encoder is not None else None)

    def parse(self, gen: Generation, context_ids: list[int] | None) -> tuple[Step, str]:
        """The step a completion makes and the error text when it is malformed ("" if not):
        a malformed step never reaches the env; the error is its observation."""
        parsed = self.format.parse(gen.text, getattr(self.env, "action_help", ""))
        step = Step(completion=gen.text, thought=parsed.thought, action=parsed.action,
                    observation="", context_ids=context_ids, completion_ids=gen.token_ids,
                    logprobs=gen.logprobs)
        return step, parsed.error

    @property
    def source(self) -> str:
        """The env's name, for grammars and messages."""
        return getattr(self.env, "name", "") or type(self.env).__name__

    def grammar(self, kind: str, space: Any = None) -> Grammar:
        """The grammar of a step in the format's frame: ``kind`` "format" or "actions" with
        ``space`` (a list of actions or rules text; see :meth:`ReActFormat.grammar`)."""
        return self.format.grammar(kind, space, self.source)

    def encode(self, text: str) -> list[int]:
        """Token ids of a given completion text (``[]`` without a tokenizer)."""
        return self.encoder.tok.encode(text) if self.encoder is not None else []


# --- structured decoding ----------------------------------------------------------------------
class ConstraintError(ValueError):
    """A ``constrain`` setting that cannot be honoured (a policy without structured decoding, an
    env without an action language, rules that do not compile): one line naming what."""


def check_mode(mode: str) -> str:
    if mode not in CONSTRAIN_MODES:
        raise ConstraintError(f"constrain must be one of {', '.join(CONSTRAIN_MODES)}, not {mode!r}")
    return mode


def policy_mode(mode: str, policy: Any) -> tuple[str, str]:
    """The mode searches run under with ``policy`` and why it differs from ``mode`` ("" if it
    does not): a policy that cannot generate under a grammar (``supports_grammar`` unset) runs
    ``auto`` unconstrained; an explicit ``format``/``actions`` with it is a ConstraintError."""
    check_mode(mode)
    if mode == "none" or getattr(policy, "supports_grammar", False):
        return mode, ""
    name = getattr(policy, "name", type(policy).__name__)
    if mode != "auto":
        raise ConstraintError(f"constrain={mode}: policy {name!r} cannot generate under a grammar "
                              f"(no structured decoding in its backend); use constrain=auto or none")
    return "none", f"policy {name!r} cannot generate under a grammar: unconstrained"


_SKIP = object()


class Constraint:
    """One search's structured decoding: the mode asked and the one in force, the grammar of
    each node's expansion (built once per node) and counts of what every generation was made
    under (:meth:`as_dict`, the result's ``constraint``)."""

    __slots__ = ("asked", "mode", "prompts", "envs", "notes", "counts", "_grammars", "_format")

    def __init__(self, asked: str, mode: str, prompts: Prompts, envs: "EnvDriver", note: str = ""):
        self.asked, self.mode, self.prompts, self.envs = asked, mode, prompts, envs
        self.notes: list[str] = [note] if note else []
        self.counts = dict.fromkeys(CONSTRAINT_COUNTS, 0)
        self._grammars: dict[int, Any] = {}
        self._format: Grammar | None = None
        env = getattr(envs.env, "name", "") or type(envs.env).__name__
        if mode != "none" and not callable(getattr(prompts.format, "grammar", None)):
            why = f"agent format {getattr(prompts.format, 'name', '?')!r} writes no grammar"
            if asked != "auto":
                raise ConstraintError(f"constrain={asked}: {why}")
            self.mode = "none"
            self.note(f"{why}: unconstrained")
        elif mode in ("auto", "actions"):
            root = envs.tree.root
            offers = envs.actions(root)[0] != ""
            if mode == "actions" and not offers:
                raise ConstraintError(f"constrain=actions: env {env!r} offers neither valid_actions() "
                                      f"nor action_grammar(); use constrain=format or auto")
            self.mode = "actions" if offers else "format"
            if not offers:
                self.note(f"env {env!r} offers no action language: the format alone")

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 8:
            self.notes.append(text)

    def grammar(self, node: "Node", count: bool = True) -> tuple[Grammar | None, str]:
        """The grammar of an expansion at ``node`` and, when the node cannot be expanded under
        the constraint asked (``actions`` where the env lists no action), the fault ("" if
        none): no request is sent then. ``count``: a fallback to the format is counted (once
        per request)."""
        mode = self.mode
        if mode == "none":
            return None, ""
        if mode == "format":
            return self._frame(), ""
        got = self._grammars.get(node.id)
        if got is None:
            got = self._grammars[node.id] = self._actions_grammar(node)
        if got is _SKIP:
            return None, f"constrain=actions: no valid action at node {node.id}"
        if got is None:
            self.counts["fallbacks"] += count
            return self._frame(), ""
        return got, ""

    def _frame(self) -> Grammar:
        if self._format is None:
            self._format = self.prompts.grammar("format")
        return self._format

    def _actions_grammar(self, node: "Node") -> Any:
        """The node's action grammar; None: fall back to the format (``auto``); _SKIP: fault."""
        kind, space = self.envs.actions(node)
        env = self.prompts.source
        if kind == "" or (kind == "list" and not space):
            if self.asked != "auto":
                return _SKIP
            self.note(f"env {env!r} listed no valid action at a non-terminal state: the format alone there")
            return None
        try:
            grammar = self.prompts.grammar("actions", space)
            if kind == "rules" and _HAVE_XGRAMMAR:
                check(grammar, "")  # compiles the env's rules (~1 ms; validate() takes ~100)
        except GrammarError as exc:
            if self.asked != "auto":
                raise ConstraintError(f"constrain={self.asked}: {exc}") from None
            self.note(f"{exc}: the format alone")
            return None
        return grammar

    def count(self, gens: list[Generation], grammar: Grammar | None) -> None:
        """Count one answered request's generations by the constraint each was made under; a
        generation the backend did not check against its grammar is checked here."""
        c = self.counts
        c["requests"] += 1
        c["generations"] += len(gens)
        for g in gens:
            if grammar is not None and not g.constraint_check and _HAVE_XGRAMMAR:
                try:
                    stamp(g, grammar)
                except Exception:  # noqa: BLE001 - an uncheckable text stays as the backend left it
                    pass
            c[g.constraint if g.constraint in ("actions", "format") else "none"] += 1
            if g.constraint_check == "violated":
                c["violations"] += 1
            elif g.constraint_check == "partial":
                c["partial"] += 1

    def as_dict(self) -> dict[str, Any]:
        """``asked`` (the setting), ``mode`` (what this search ran under), the counts and notes."""
        return {"asked": self.asked, "mode": self.mode, **self.counts, "notes": list(self.notes)}


_HAVE_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
