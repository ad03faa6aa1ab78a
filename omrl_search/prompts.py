"""What the policy is shown at a node: one :class:`Prompts` per search, owned by the agent format.

The engine asks for a node's step prompt (chat messages, and with a tokenizer the exact token ids)
or for a free-form ``ask`` prompt, and turns a completion into a :class:`~omrl_search.types.Step`;
how any of these look is the agent format's business (:meth:`ReActFormat.prompts` builds this
object), so a different format changes prompts without touching the engine (see docs/design.md §4).

Messages are built once per node and cached (a child's chat is its parent's plus two turns).
With a :class:`~omrl_search.agent.TurnEncoder`, a step's prompt ids are the ids recorded along the
node's path plus the new turn, copied once, never re-rendered, so a trajectory's ids are exactly
what the policy saw.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .types import Generation, Step, Task

if TYPE_CHECKING:  # pragma: no cover
    from .agent import ReActFormat, TurnEncoder
    from .tree import Node, SearchTree

Messages = list[dict[str, str]]


class Prompts:
    """One search's prompts in an agent format: step prompts per node, ask prompts, steps parsed.

    ``stop`` is the format's stop strings (used when the sampling parameters name none)."""

    __slots__ = ("format", "encoder", "env", "task", "tree", "stop", "_messages")

    def __init__(self, fmt: "ReActFormat", encoder: "TurnEncoder | None", env: Any, task: Task,
                 tree: "SearchTree"):
        self.format, self.encoder, self.env, self.task, self.tree = fmt, encoder, env, task, tree
        self.stop: tuple[str, ...] = fmt.stop
        self._messages: dict[int, Messages] = {}

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
        step = Step(gen.text, parsed.thought, parsed.action, "", context_ids=context_ids,
                    completion_ids=gen.token_ids, logprobs=gen.logprobs)
        return step, parsed.error

    def encode(self, text: str) -> list[int]:
        """Token ids of a given completion text (``[]`` without a tokenizer)."""
        return self.encoder.tok.encode(text) if self.encoder is not None else []
