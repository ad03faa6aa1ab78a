"""Requests: one job, building the LM requests of a tree's ``expand`` or ``ask`` (docs/design.md §5).

A request is built when its tree yields the op, in that tree's own order, so its sampling seed
(:class:`~omrl_search.ops.Seeds`, from the search's seed, the node and the search's request
count) depends on its tree alone, never on the schedule. An expansion's request carries the
grammar the search's :class:`~omrl_search.prompts.Constraint` gives its node; a node that cannot
be expanded under the constraint asked is failed here and sends nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .batching import LMWait
from .ops import AskOp, ExpandOp, Op
from .tree import FAILED
from .types import GenRequest, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .agent import ReActFormat
    from .ops import SearchContext
    from .tree import Node

#: the answer of a request that was not sent (a node the engine would not expand)
SKIPPED = object()


class RequestBuilder:
    """Builds every LM request of one engine from its ``sampling`` defaults and agent format."""

    __slots__ = ("sampling", "agent_format")

    def __init__(self, sampling: SamplingParams, agent_format: "ReActFormat"):
        self.sampling, self.agent_format = sampling, agent_format

    def wait(self, i: int, op: Op) -> LMWait:
        """The requests of tree ``i``'s expand or ask, as one :class:`LMWait`; an expand's
        ``work`` keeps each request's context ids and grammar for its children."""
        ctx = op.ctx
        if type(op) is ExpandOp:
            notes, work, requests = op.notes, [], []
            for j, node in enumerate(op.nodes):
                grammar, fault = ctx.constraint.grammar(node) if ctx.constraint else (None, "")
                if fault:  # the node cannot be expanded under the constraint asked: no LM call
                    ctx.faults.append(f"constrain: {fault}")
                    ctx.constraint.counts["skipped"] += 1
                    node.status, node.error = FAILED, fault
                    work.append(None)
                    requests.append(None)
                    continue
                context_ids, req = self.step_request(ctx, node, op.k, op.temperature,
                                                     notes[j] if notes else "")
                req.grammar = grammar
                work.append((context_ids, grammar))
                requests.append(req)
            return LMWait(i, op, work, requests, SKIPPED)
        if type(op) is not AskOp:
            raise TypeError(f"a strategy awaited {op!r}, not an engine op")
        requests = [self.ask_request(ctx, node, prompt, op.n, op.temperature, op.max_tokens, op.stop)
                    for node, prompt in zip(op.nodes, op.prompts)]
        return LMWait(i, op, [None] * len(requests), requests)

    def step_request(self, ctx: "SearchContext", node: "Node", k: int, temperature: float | None,
                     note: str) -> tuple[list[int] | None, GenRequest]:
        """``k`` agent steps at ``node``: the node's context ids (for its children) and the request."""
        messages, context_ids, prompt_ids = ctx.prompts.step(node, note)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(temperature=s.temperature if temperature is None else temperature,
                                top_p=s.top_p, max_tokens=s.max_tokens,
                                stop=s.stop or ctx.prompts.stop, n=k,
                                seed=ctx.seeds.step(node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env,
                "agent": self.agent_format}
        return context_ids, GenRequest(messages, params, prompt_ids, meta)

    def ask_request(self, ctx: "SearchContext", node: "Node", prompt: Any, n: int,
                    temperature: float | None, max_tokens: int | None,
                    stop: tuple[str, ...]) -> GenRequest:
        """``n`` free-form answers to ``prompt`` about ``node``."""
        messages, prompt_ids = ctx.prompts.ask(prompt)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(temperature=s.temperature if temperature is None else temperature,
                                top_p=s.top_p, max_tokens=max_tokens or s.max_tokens, stop=stop,
                                n=n, seed=ctx.seeds.ask(node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "ask": True}
        return GenRequest(messages, params, prompt_ids, meta)
