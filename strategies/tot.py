"""Tree-of-Thoughts (Yao et al., NeurIPS 2023, "Tree of Thoughts: Deliberate Problem Solving
with Large Language Models"): a proposer G suggests next thoughts, an evaluator V values states.

BFS (the paper's Algorithm 1, as its code runs it)::

    S <- [root]
    for each depth:
        S' <- [children z of s | s in S in order, z in G(s)]   repeats kept unless dedup is set
        V  <- V(S'); a repeat within the step is valued 0; a finished state without an answer 0
        S  <- the b states of S' with the highest V, best first (ties: proposal order)
              finished ones are set aside
    answer <- the best-valued finished state

DFS (Algorithm 2)::

    dfs(s): if s is finished: stop when V(s) >= accept, else backtrack
            for s' in G(s) by decreasing V, skipping V(s') < threshold: dfs(s')

Knobs (docs/strategies.md has each with the paper's setting): ``method`` (bfs | dfs), ``b``
(BFS breadth), ``k`` (samples per state for ``sample``, 3 when not given; for ``propose``, the
proposals kept, all when not given, and only then written into the prompt), ``evaluator`` (a
value source name — auto | lm | rm | heuristic | logprob — or any object with ``async
__call__(ctx, nodes) -> values``), ``n_evaluate``, ``value_map`` and ``value_agg`` (the LM value
prompt's samples, labels and their sum or mean), ``proposer`` (``sample``: k i.i.d. agent
steps; ``propose``: one LM call listing next steps, the paper's Game-of-24 proposer; or any
object with ``async __call__(ctx, nodes, k) -> children``), ``order`` (value | proposal),
``dedup`` (none | state | text), ``zero_repeats``, ``last_step`` (answer | value),
``threshold`` and ``accept`` (DFS), ``temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable

from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import PRUNED
from omrl_search.types import PROPOSAL_MAX_TOKENS

from .values import (ANSWER_PROMPT, ORDERS, best_answer, check_dedup, check_value,
                     dedup_nodes, engine_dedup, history, keep_best, last_step_values, make_value,
                     parse_mapping, remember, zero_repeats)

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext

PROPOSE_PROMPT = (
    "Task: {task}\n\nSteps so far:\n{history}\n\nCurrent state:\n{state}\n\n"
    "Allowed actions:\n{actions}\n\nList the possible next actions, one per line, "
    "each written as 'Act: <action>'."
)
PROPOSE_PROMPT_K = (
    "Task: {task}\n\nSteps so far:\n{history}\n\nCurrent state:\n{state}\n\n"
    "Allowed actions:\n{actions}\n\nList {k} different possible next actions, one per line, "
    "each written as 'Act: <action>'."
)
SAMPLES = 3  # samples per state of the ``sample`` proposer when ``k`` is not given


class SampleProposer:
    """ToT's *sample* generator: k independent agent-format steps per state. ``dedup="state"``
    lets the engine merge siblings with equal states; the strategy's ``dedup`` rule applies to
    the candidates in any case."""

    def __init__(self, temperature: float | None = None, dedup: str = "none"):
        self.temperature, self.dedup = temperature, dedup

    async def __call__(self, ctx, nodes, k: int | None):
        return await ctx.expand(nodes, SAMPLES if k is None else k, temperature=self.temperature,
                                dedup=engine_dedup(self.dedup))


class ProposePrompt:
    """ToT's *propose* generator: one LM answer lists next actions, each applied.

    All listed actions are applied (ToT keeps every line of the answer) unless ``k`` is given;
    ``k`` is written into the prompt only then. ``prompt`` is a format string (``{task}``,
    ``{history}``, ``{state}``, ``{actions}``, and ``{k}`` when k is given) or a function
    ``(ctx, node, k) -> str``; ``parse`` turns the answer into actions. ``dedup`` as for
    :class:`SampleProposer`.
    """

    def __init__(self, prompt: "str | Callable | None" = None,
                 parse: Callable[[str], list[str]] | None = None, temperature: float | None = None,
                 max_tokens: int = PROPOSAL_MAX_TOKENS, dedup: str = "none"):
        self.prompt, self.parse = prompt, parse or self.parse_actions
        self.temperature, self.max_tokens, self.dedup = temperature, max_tokens, dedup

    @staticmethod
    def parse_actions(text: str) -> list[str]:
        acts = []
        for line in text.splitlines():
            head, sep, rest = line.partition(":")
            if sep and head.strip().strip("*-0123456789. ").lower() in ("act", "action"):
                acts.append(rest.strip().strip("`"))
        return [a for a in acts if a]

    def render(self, ctx, node, k: int | None) -> str:
        prompt = self.prompt
        if callable(prompt):
            return prompt(ctx, node, k)
        if prompt is None:
            prompt = PROPOSE_PROMPT if k is None else PROPOSE_PROMPT_K
        elif k is None and "{k}" in prompt:
            raise ValueError("the propose prompt writes {k}, but no k was given")
        return prompt.format(task=ctx.task.instruction, history=history(ctx, node),
                             state=node.observation, k=k,
                             actions=getattr(ctx.env, "action_help", ""))

    async def __call__(self, ctx, nodes, k: int | None):
        answers = await ctx.ask(nodes, [self.render(ctx, n, k) for n in nodes],
                                temperature=self.temperature, max_tokens=self.max_tokens)
        dedup = engine_dedup(self.dedup)
        return [ctx.apply(n, [f"Think: proposed step.\nAct: {a}" for a in self.parse(t[0])[:k]],
                          dedup=dedup) if t else [] for n, t in zip(nodes, answers)]


@register_strategy("tot")
@dataclass
class TreeOfThoughts(Strategy):
    method: str = "bfs"
    b: int = 5
    k: int | None = None
    evaluator: Any = "auto"
    n_evaluate: int = 3
    value_map: Any = "sure:20/likely:1/impossible:0.001"
    value_agg: str = "sum"
    proposer: Any = "sample"
    order: str = "value"
    dedup: str = "none"
    zero_repeats: bool = True
    last_step: str = "answer"
    threshold: float = 0.01
    accept: float = 0.5
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.method not in ("bfs", "dfs"):
            raise ValueError(f"method must be bfs or dfs, got {self.method!r}")
        if self.b < 1 or (self.k is not None and self.k < 1) or self.n_evaluate < 1:
            raise ValueError("b, k and n_evaluate must be >= 1")
        if isinstance(self.proposer, str) and self.proposer not in ("sample", "propose"):
            raise ValueError(f"proposer must be sample or propose, got {self.proposer!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.value_agg not in ("sum", "mean"):
            raise ValueError(f"value_agg must be sum or mean, got {self.value_agg!r}")
        if self.last_step not in ("answer", "value"):
            raise ValueError(f"last_step must be answer or value, got {self.last_step!r}")
        check_dedup(self.dedup)
        parse_mapping(self.value_map)
        check_value(self.evaluator, ("auto", "lm", "rm", "heuristic", "logprob"))

    def _parts(self, ctx):
        value = make_value(self.evaluator, ctx, "last", n=self.n_evaluate,
                           mapping=parse_mapping(self.value_map), reduce=self.value_agg,
                           answer_prompt=ANSWER_PROMPT if self.last_step == "answer" else None,
                           cache_by="prompt")
        if self.proposer == "sample":
            return SampleProposer(self.temperature, self.dedup), value
        if self.proposer == "propose":
            return ProposePrompt(temperature=self.temperature, dedup=self.dedup), value
        return self.proposer, value

    async def run(self, ctx: SearchContext) -> None:
        propose, value = self._parts(ctx)
        if self.method == "bfs":
            await self._bfs(ctx, propose, value)
        else:
            await self._dfs(ctx, propose, value)

    async def _step(self, ctx, propose, value, states):
        """One generation and evaluation: the candidates of ``states`` and their values."""
        kids = await propose(ctx, states, self.k)
        candidates = dedup_nodes(ctx, chain.from_iterable(kids), self.dedup)
        if not candidates:
            return [], []
        values = await value(ctx, candidates)
        if self.last_step == "answer":
            values = last_step_values(candidates, values)
        if self.zero_repeats:
            values = zero_repeats(ctx, candidates, values)
        return candidates, values

    async def _bfs(self, ctx, propose, value) -> None:
        states = [ctx.root]
        while states:
            candidates, values = await self._step(ctx, propose, value, states)
            if not candidates:
                return
            kept = keep_best(ctx, candidates, values, self.b, "not in the b best", self.order)
            states = [s for s in kept if ctx.expandable(s)]

    async def _dfs(self, ctx, propose, value) -> None:
        values = ctx.values
        stack = [ctx.root]
        while stack:
            s = stack.pop()
            if not ctx.expandable(s):
                if s.terminal and values.get(s.id, 0.0) >= self.accept:
                    ctx.answer = s
                    return
                continue  # a dead end: backtrack
            kids, vals = await self._step(ctx, propose, value, [s])
            remember(ctx, kids, vals)
            good = []
            for i, v in enumerate(vals):
                if v >= self.threshold:
                    good.append(i)
                else:
                    kids[i].status, kids[i].error = PRUNED, "below the value threshold"
            # best on top; of equal values the earlier proposed: a stable sort of the
            # reversed indices (every kept value passed the threshold, so none is NaN)
            stack += [kids[i] for i in sorted(reversed(good), key=vals.__getitem__)]

    def select(self, ctx: SearchContext):
        return ctx.answer or best_answer(ctx)
