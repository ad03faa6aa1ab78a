"""Tree-of-Thoughts (Yao et al., NeurIPS 2023, "Tree of Thoughts: Deliberate Problem Solving
with Large Language Models"): a proposer G suggests next thoughts, an evaluator V values states.

BFS (the paper's Algorithm 1)::

    S <- {root}
    for each depth:
        S' <- {children z of s | s in S, z in G(s, k)}      duplicates at a depth scored once
        S  <- the b states of S' with the highest V            finished ones are set aside
    answer <- the best-valued finished state

DFS (Algorithm 2)::

    dfs(s): if s is finished: stop when V(s) >= accept, else backtrack
            for s' in G(s, k) by decreasing V, skipping V(s') < threshold: dfs(s')

Knobs: ``method`` (bfs | dfs), ``b`` (BFS breadth), ``k`` (proposals per state), ``evaluator``
(a value source name — auto | lm | rm | heuristic | logprob — or any object with
``async __call__(ctx, nodes) -> values``), ``n_evaluate`` (samples of the LM value prompt),
``proposer`` (``sample``: k i.i.d. agent steps; ``propose``: one LM call listing k steps, the
paper's Game-of-24 proposer; or any object with ``async __call__(ctx, nodes, k) -> children``),
``threshold`` and ``accept`` (DFS), ``temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import PRUNED, unique_states

from .values import best_answer, check_value, history, keep_best, make_value, remember

PROPOSE_PROMPT = (
    "Task: {task}\n\nSteps so far:\n{history}\n\nCurrent state:\n{state}\n\n"
    "Allowed actions:\n{actions}\n\nList {k} different possible next actions, one per line, "
    "each written as 'Act: <action>'."
)


class SampleProposer:
    """ToT's *sample* generator: k independent agent-format steps per state."""

    def __init__(self, temperature: float | None = None):
        self.temperature = temperature

    async def __call__(self, ctx, nodes, k: int):
        return await ctx.expand(nodes, k, temperature=self.temperature, dedup=True)


class ProposePrompt:
    """ToT's *propose* generator: one LM answer lists up to k next actions, each applied.

    ``prompt`` is a format string (``{task}``, ``{history}``, ``{state}``, ``{actions}``, ``{k}``)
    or a function ``(ctx, node, k) -> str``; ``parse`` turns the answer into actions.
    """

    def __init__(self, prompt: "str | Callable" = PROPOSE_PROMPT,
                 parse: Callable[[str], list[str]] | None = None, temperature: float | None = None,
                 max_tokens: int = 160):
        self.prompt, self.parse = prompt, parse or self.parse_actions
        self.temperature, self.max_tokens = temperature, max_tokens

    @staticmethod
    def parse_actions(text: str) -> list[str]:
        acts = []
        for line in text.splitlines():
            head, sep, rest = line.partition(":")
            if sep and head.strip().strip("*-0123456789. ").lower() in ("act", "action"):
                acts.append(rest.strip().strip("`"))
        return [a for a in acts if a]

    def render(self, ctx, node, k: int) -> str:
        if callable(self.prompt):
            return self.prompt(ctx, node, k)
        return self.prompt.format(task=ctx.task.instruction, history=history(ctx, node),
                                  state=node.observation, k=k,
                                  actions=getattr(ctx.env, "action_help", ""))

    async def __call__(self, ctx, nodes, k: int):
        answers = await ctx.ask(nodes, [self.render(ctx, n, k) for n in nodes],
                                temperature=self.temperature, max_tokens=self.max_tokens)
        return [ctx.apply(n, [f"Think: proposed step.\nAct: {a}" for a in self.parse(t[0])[:k]])
                if t else [] for n, t in zip(nodes, answers)]


@register_strategy("tot")
@dataclass
class TreeOfThoughts(Strategy):
    method: str = "bfs"
    b: int = 5
    k: int = 3
    evaluator: Any = "auto"
    n_evaluate: int = 3
    proposer: Any = "sample"
    threshold: float = 0.01
    accept: float = 0.5
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.method not in ("bfs", "dfs"):
            raise ValueError(f"method must be bfs or dfs, got {self.method!r}")
        if self.b < 1 or self.k < 1 or self.n_evaluate < 1:
            raise ValueError("b, k and n_evaluate must be >= 1")
        if isinstance(self.proposer, str) and self.proposer not in ("sample", "propose"):
            raise ValueError(f"proposer must be sample or propose, got {self.proposer!r}")
        check_value(self.evaluator, ("auto", "lm", "rm", "heuristic", "logprob"))

    def _parts(self, ctx):
        value = make_value(self.evaluator, ctx, "last", n=self.n_evaluate)
        if self.proposer == "sample":
            return SampleProposer(self.temperature), value
        if self.proposer == "propose":
            return ProposePrompt(temperature=self.temperature), value
        return self.proposer, value

    async def run(self, ctx) -> None:
        propose, value = self._parts(ctx)
        if self.method == "bfs":
            await self._bfs(ctx, propose, value)
        else:
            await self._dfs(ctx, propose, value)

    async def _bfs(self, ctx, propose, value) -> None:
        states = [ctx.root]
        while states:
            kids = await propose(ctx, states, self.k)
            candidates = unique_states(c for cs in kids for c in cs)
            if not candidates:
                return
            kept = keep_best(ctx, candidates, await value(ctx, candidates), self.b, "not in the b best")
            states = [s for s in kept if ctx.expandable(s)]

    async def _dfs(self, ctx, propose, value) -> None:
        values = ctx.scratch.setdefault("values", {})
        stack = [ctx.root]
        while stack:
            s = stack.pop()
            if not ctx.expandable(s):
                if s.terminal and values.get(s.id, 0.0) >= self.accept:
                    ctx.scratch["answer"] = s
                    return
                continue  # a dead end: backtrack
            (kids,) = await propose(ctx, [s], self.k)
            kids = unique_states(kids)
            vals = await value(ctx, kids)
            remember(ctx, kids, vals)
            good = [i for i, v in enumerate(vals) if v >= self.threshold]
            for i in sorted(set(range(len(kids))) - set(good)):
                kids[i].status, kids[i].error = PRUNED, "below the value threshold"
            stack += [kids[i] for i in sorted(good, key=lambda i: (vals[i], -i))]  # best on top

    def select(self, ctx):
        return ctx.scratch.get("answer") or best_answer(ctx)
