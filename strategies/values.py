"""Value sources and frontier helpers shared by beam, ToT, GoT and MCTS.

A value source scores nodes, ``await source(ctx, nodes) -> list[float]`` (higher is better, in
[0, 1] for the built-in ones unless given another label map). Per-step sources give each step (or state) a value and reduce the
values along the path with ``agg`` — ``last | min | mean | prod``, search-and-learn's convention.
Values are cached per search in ``ctx.value_caches`` (by source), so a node (or, for state values, a state) is
scored once (``logprob`` with ``agg=last`` recomputes instead: one ``exp`` of a sum costs less).

* ``rm`` — the reward model (``ctx.evaluate``), per-step scores reduced by ``agg``;
* ``heuristic`` — the env's own ``heuristic()`` of each state, for envs that offer one;
* ``lm`` — LM self-evaluation as in Tree-of-Thoughts: the LM judges each state *sure*, *likely*
  or *impossible*, sampled ``n`` times, mapped to numbers (a configurable label map) and
  averaged or summed (needs a policy that answers free-form prompts);
* ``logprob`` — the policy's own probability of each step (``exp`` of its summed token
  logprobs); free, but with a real LM it favours short steps;
* ``rollout`` — roll out to a terminal and score 1 if the env reports success. This consults
  the env's success check, so searches using it are flagged ``verifier_in_loop``;
* ``auto`` — ``rm`` when the search has a reward model, else ``heuristic`` when the env has one,
  else ``lm`` when the policy answers prompts, else ``logprob`` (the fallback for scripted
  policies, which only pick actions).

The frontier helpers say which nodes go on and in what order (:func:`keep_best`), which
repeats are merged (:func:`dedup_nodes`: ``none | state | text``) and ToT's two value rules
(:func:`zero_repeats`, :func:`last_step_values`).
"""
from __future__ import annotations

import math
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Iterable, Sequence

from omrl_search.reward import AGGREGATIONS, aggregate
from omrl_search.tree import FAILED, PRUNED, TERMINAL, Node, unique_states
from omrl_search.types import VERDICT_MAX_TOKENS

SOURCES = ("auto", "rm", "heuristic", "lm", "logprob", "rollout")
_ID = attrgetter("id")


class ValueSource:
    """Base of the per-step sources: scores missing steps, caches, reduces along the path."""

    name = ""
    by_state = False  # cache by state key (the value depends on the state only) or by node id

    def __init__(self, agg: str = "last"):
        if agg not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {agg!r} (known: {', '.join(AGGREGATIONS)})")
        self.agg = agg

    def cache_key(self, ctx) -> Callable[[Node], Any]:
        """What a value is cached by: the state key (``by_state``) or the node id."""
        return attrgetter("state_key" if self.by_state else "id")

    async def __call__(self, ctx, nodes: Sequence[Node]) -> list[float]:
        cache = ctx.value_caches.setdefault((self.name,), {})
        key = self.cache_key(ctx)
        todo: dict[Any, Node] = {}  # the first node of each key not yet valued, in order
        # ``last`` needs each node's own value only: no path walked, no ancestor valued
        if self.agg == "last":
            keys = [None if n.status == FAILED else key(n) for n in nodes]
            for k, n in zip(keys, nodes):
                if k is not None and k not in cache and k not in todo:
                    todo[k] = n
            if todo:
                cache.update(zip(todo, await self.step_values(ctx, list(todo.values()))))
            return [0.0 if k is None else cache[k] for k in keys]
        paths = [ctx.tree.path(n)[1:] for n in nodes]
        by_id: dict[int, Any] = {}  # each node's cache key, made once (a prompt key renders it)
        for n in chain.from_iterable(paths):
            if n.id not in by_id:
                k = by_id[n.id] = None if n.status == FAILED else key(n)
                if k is not None and k not in cache:
                    todo.setdefault(k, n)
        if todo:
            cache.update(zip(todo, await self.step_values(ctx, list(todo.values()))))
        return [aggregate([0.0 if (k := by_id[n.id]) is None else cache[k] for n in p], self.agg)
                for p in paths]

    async def step_values(self, ctx, nodes: list[Node]) -> list[float]:  # pragma: no cover
        raise NotImplementedError


class RMValue(ValueSource):
    """The reward model's per-step scores of each path, reduced by ``agg``."""

    name = "rm"

    async def __call__(self, ctx, nodes: Sequence[Node]) -> list[float]:
        cache = ctx.value_caches.setdefault(("rm", self.agg), {})
        todo = list({n.id: n for n in nodes if n.id not in cache}.values())
        if todo:
            cache.update(zip((n.id for n in todo), await ctx.evaluate(todo, aggregation=self.agg)))
        return [cache[n.id] for n in nodes]


class HeuristicValue(ValueSource):
    """The env's ``heuristic()`` of each state on the path."""

    name, by_state = "heuristic", True

    async def step_values(self, ctx, nodes: list[Node]) -> list[float]:
        return ctx.heuristic(nodes)


class LogprobValue(ValueSource):
    """The policy's probability of each step; 1 for steps without logprobs."""

    name = "logprob"

    async def step_values(self, ctx, nodes: list[Node]) -> list[float]:
        return [step_prob(n) for n in nodes]


def step_logprob(node: Node) -> float:
    """Summed token logprob of the step that led to ``node`` (0 when unknown)."""
    lps = node.step.logprobs if node.step is not None else None
    return math.fsum(lps) if lps else 0.0


def step_prob(node: Node) -> float:
    return math.exp(step_logprob(node))


VALUE_PROMPT = (
    "Evaluate a partial attempt at a task.\n\nTask: {task}\n\nSteps so far:\n{history}\n\n"
    "Current state:\n{state}\n\nCan the task still be completed from this state? Reason in one "
    "or two sentences, then give your verdict as the last word: sure, likely or impossible."
)
#: ToT's last-step judgement: the answer alone, judged sure or impossible (the env's verdict in
#: the final observation is not shown: the LM judges, not the env)
ANSWER_PROMPT = (
    "Judge a final answer to a task.\n\nTask: {task}\n\nSteps taken:\n{history}\n\n"
    "Final answer: {answer}\n\nIs this answer correct and does it follow the task's rules? "
    "Reason in one or two sentences, then give your verdict as the last word: sure or impossible."
)
#: ToT's value map for Game of 24 (``value_outputs_unwrap``), summed over the samples
PAPER_MAPPING = {"sure": 20.0, "likely": 1.0, "impossible": 0.001}


def history(ctx, node: Node) -> str:
    steps = [n.step for n in ctx.tree.path(node)[1:]]
    return "\n".join(f"{i}. {s.action or '(invalid)'}" for i, s in enumerate(steps, 1)) or "(none)"


def answered(node: Node) -> bool:
    """Whether the env itself ended the episode at ``node`` (an answer state): not cut by a
    step limit, the depth limit or a fault."""
    return node.terminal and node.status == TERMINAL and not node.error


def parse_mapping(spec: "str | dict[str, float]") -> dict[str, float]:
    """``"sure:20/likely:1/impossible:0.001"`` (or a dict) -> ``{label: score}``."""
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in str(spec).split("/"))):
            label, sep, score = part.partition(":")
            if not sep:
                raise ValueError(f"value map {spec!r}: expected label:score, got {part!r}")
            items.append((label, score))
    try:
        out = {str(k).strip().lower(): float(v) for k, v in items}
    except ValueError:
        raise ValueError(f"value map {spec!r}: each score must be a number") from None
    if not out:
        raise ValueError(f"value map {spec!r} is empty")
    return out


class LMValue(ValueSource):
    """Tree-of-Thoughts' value prompt: ``n`` sampled verdicts per state, mapped and reduced.

    ``mapping`` (label -> score; default the paper's sure/likely/impossible = 20/1/0.001 scaled
    by 1/20 into [0, 1], which MCTS's PUCT needs) and ``reduce`` (``mean`` or the paper's
    ``sum``) turn the samples into a value; a sample with no verdict counts 0. ``prompt`` is a
    format string with ``{task}``, ``{history}``, ``{state}``, or a function ``(ctx, node) ->
    str``. ``answer_prompt`` (same fields plus ``{answer}``), when given, judges answer states
    instead (ToT's last step). ``cache_by``: ``state`` (a state is scored once) or ``prompt``
    (ToT's ``value_cache``, keyed by the prompt text: a prompt that shows the history scores
    each history once).
    """

    name, by_state = "lm", True
    MAPPING = {k: v / 20.0 for k, v in PAPER_MAPPING.items()}

    def __init__(self, agg: str = "last", n: int = 3, mapping: "dict[str, float] | str | None" = None,
                 prompt: "str | Callable[[Any, Node], str]" = VALUE_PROMPT, reduce: str = "mean",
                 temperature: float | None = None, max_tokens: int = VERDICT_MAX_TOKENS,
                 answer_prompt: "str | Callable[[Any, Node], str] | None" = None,
                 cache_by: str = "state"):
        super().__init__(agg)
        if n < 1 or reduce not in ("mean", "sum") or cache_by not in ("state", "prompt"):
            raise ValueError(f"LMValue needs n >= 1, reduce mean|sum and cache_by state|prompt "
                             f"(got n={n}, reduce={reduce!r}, cache_by={cache_by!r})")
        self.n, self.prompt, self.reduce = n, prompt, reduce
        self.mapping = parse_mapping(self.MAPPING if mapping is None else mapping)
        self.answer_prompt, self.cache_by = answer_prompt, cache_by
        self.temperature, self.max_tokens = temperature, max_tokens

    def cache_key(self, ctx) -> Callable[[Node], Any]:
        if self.cache_by == "prompt":
            return lambda n: self.render(ctx, n)
        return super().cache_key(ctx)

    def render(self, ctx, node: Node) -> str:
        prompt = self.prompt
        if self.answer_prompt is not None and answered(node):
            prompt = self.answer_prompt
        if callable(prompt):
            return prompt(ctx, node)
        return prompt.format(task=ctx.task.instruction, history=history(ctx, node),
                             state=node.observation,
                             answer=node.step.action if node.step is not None else "")

    def verdict(self, text: str) -> float:
        words = [w.strip(".,:;!*'\"()") for w in text.lower().split()]
        return next((self.mapping[w] for w in reversed(words) if w in self.mapping), 0.0)

    async def step_values(self, ctx, nodes: list[Node]) -> list[float]:
        texts = await ctx.ask(nodes, [self.render(ctx, n) for n in nodes], n=self.n,
                              temperature=self.temperature, max_tokens=self.max_tokens)
        out = []
        for samples in texts:
            vals = [self.verdict(t) for t in samples]
            total = math.fsum(vals)
            out.append(total if self.reduce == "sum" else total / max(len(vals), 1))
        return out


class RolloutValue:
    """1 when a rollout from the node reaches a successful terminal, else 0 (the env's
    verifier: flags the search). The leaf reached is remembered in ``ctx.rollout_leaves``."""

    name = "rollout"

    def __init__(self, temperature: float | None = None):
        self.temperature = temperature

    async def __call__(self, ctx, nodes: Sequence[Node]) -> list[float]:
        leaves = await ctx.rollout(nodes, temperature=self.temperature)
        seen = ctx.rollout_leaves
        out = []
        for node, leaf in zip(nodes, leaves):
            seen[node.id] = leaf.id
            out.append(1.0 if leaf.status != FAILED and ctx.verify(leaf) else 0.0)
        return out


class Mix:
    """``(1 - lam) * first + lam * second`` (e.g. AlphaGo's mix of a value model and rollouts)."""

    def __init__(self, first: Any, second: Any, lam: float):
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        self.first, self.second, self.lam = first, second, lam
        self.name = f"mix({first.name},{second.name},{lam})"

    async def __call__(self, ctx, nodes: Sequence[Node]) -> list[float]:
        a = await self.first(ctx, nodes)
        b = await self.second(ctx, nodes)
        return [(1 - self.lam) * x + self.lam * y for x, y in zip(a, b)]


def make_value(spec: Any, ctx, agg: str = "last", **lm_options: Any) -> Any:
    """A value source from its name (resolving ``auto`` for this search) or an object."""
    if not isinstance(spec, str):
        return spec
    if spec == "auto":
        spec = ("rm" if ctx.has_reward_model else "heuristic" if ctx.has_heuristic
                else "lm" if ctx.can_ask else "logprob")
    if spec == "rm":
        return RMValue(agg)
    if spec == "heuristic":
        return HeuristicValue(agg)
    if spec == "lm":
        return LMValue(agg, **lm_options)
    if spec == "logprob":
        return LogprobValue(agg)
    if spec == "rollout":
        return RolloutValue()
    raise ValueError(f"unknown value source {spec!r} (known: {', '.join(SOURCES)})")


def check_value(spec: Any, allowed: Sequence[str] = SOURCES) -> None:
    """Validate a value-source knob at construction (strings only; objects pass)."""
    if isinstance(spec, str) and spec not in allowed:
        raise ValueError(f"unknown value source {spec!r} (known: {', '.join(allowed)})")


# --- policy priors over a few valid actions ---------------------------------------------------------
async def scored_actions(ctx, nodes: Sequence[Node], max_actions: int
                         ) -> dict[int, list[tuple[str, float]]]:
    """For each of ``nodes`` whose env lists between 1 and ``max_actions`` valid actions:
    every action written as a step in the agent format (an empty thought) and the policy's
    logprob of it, all scored in one batched call (``ctx.score_actions``). Nodes not listed
    (too many actions, or none listed) are left out: the caller samples those."""
    fmt = ctx.prompts.format
    todo = []
    for n in nodes:
        acts = ctx.valid_actions(n)
        if acts and len(acts) <= max_actions:
            todo.append((n, [fmt.render("", a) for a in dict.fromkeys(acts)]))
    if not todo:
        return {}
    scores = await ctx.score_actions([n for n, _ in todo], [c for _, c in todo])
    return {n.id: list(zip(comps, lps)) for (n, comps), lps in zip(todo, scores)}


def softmax(logprobs: Sequence[float]) -> list[float]:
    """Normalised probabilities of ``logprobs`` (uniform when all are ``-inf``)."""
    if not logprobs:
        return []
    top = max(logprobs)
    if top == -math.inf:
        return [1.0 / len(logprobs)] * len(logprobs)
    w = [math.exp(lp - top) for lp in logprobs]
    z = math.fsum(w)
    return [x / z for x in w]


# --- frontier helpers --------------------------------------------------------------------------
def remember(ctx, nodes: Sequence[Node], values: Sequence[float]) -> None:
    """Record the strategy's values of nodes (read by :func:`best_answer`)."""
    ctx.values.update(zip(map(_ID, nodes), values))


ORDERS = ("value", "proposal")


def keep_best(ctx, nodes: Sequence[Node], values: Sequence[float], n: int, why: str,
              order: str = "proposal") -> list[Node]:
    """The ``n`` best nodes by value (ties: earlier first); the others are marked pruned.

    ``order`` is the order they come back in, which is the order the next step expands them:
    ``value`` (descending value, ties in proposal order: ToT's ``sorted(..., reverse=True)``
    and GoT's ``KeepBestN``) or ``proposal`` (the order they were proposed: search-and-learn's
    beam keeps its beams in index order)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    remember(ctx, nodes, values)
    neg = [-v for v in values]
    ranked = sorted(range(len(nodes)), key=neg.__getitem__)  # stable: ties stay in order
    kept = ranked[:n] if order == "value" else sorted(ranked[:n])
    for i in ranked[n:]:
        nodes[i].status, nodes[i].error = PRUNED, why
    return [nodes[i] for i in kept]


# --- duplicates: none | state | text -------------------------------------------------------------
DEDUP = ("none", "state", "text")


def check_dedup(mode: str) -> None:
    if mode not in DEDUP:
        raise ValueError(f"dedup must be one of {', '.join(DEDUP)}, got {mode!r}")


def engine_dedup(mode: str) -> bool:
    """The engine's ``expand``/``apply`` flag for a dedup mode: the engine merges by state only;
    ``text`` is grouped by the strategy (:func:`dedup_nodes`)."""
    return mode == "state"


def step_text(node: Node) -> str:
    """The text of the step that led to ``node``: its action, else its completion."""
    step = node.step
    return (step.action or step.completion) if step else ""


def text_key(ctx, node: Node) -> int:
    """An id shared by nodes reached by the same action texts from the root (ToT's ``y``: the
    whole output so far). Two children of one parent share it when they wrote the same
    action; interned per search, so the key is computed once per node."""
    keys = ctx.text_keys
    if keys is None:  # made once per search
        keys = ctx.text_keys = ({}, {})
    by_node, by_path = keys
    key = by_node.get(node.id)
    if key is None:
        key = 0  # the root
        if node.parent is not None:
            path = (text_key(ctx, ctx.tree.nodes[node.parent]), step_text(node))
            key = by_path.setdefault(path, len(by_path) + 1)
        by_node[node.id] = key
    return key


def dedup_nodes(ctx, nodes: Iterable[Node], mode: str, seen: set | None = None) -> list[Node]:
    """``nodes`` without failed or pruned ones and, by ``mode``, without repeats: ``none`` keeps
    repeats, ``state`` drops a node whose dedup key was met before (:func:`unique_states`; the
    env's ``dedup_key``, by default its state key),
    ``text`` one whose action texts from the root were (:func:`text_key`). A dropped repeat is
    marked pruned as a duplicate; ``seen`` (keys met before) is updated in place."""
    if mode == "state":
        return unique_states(nodes, seen)
    if mode == "none":
        return [n for n in nodes if n.status not in (FAILED, PRUNED)]
    return unique_states(nodes, seen, key=lambda n: text_key(ctx, n))


def zero_repeats(ctx, nodes: Sequence[Node], values: Sequence[float]) -> list[float]:
    """ToT's ``get_values`` rule: a candidate repeating an earlier one of the same step (same
    action texts from the root) is valued 0, so the copy does not take a second slot."""
    seen: set = set()
    out = []
    nodes_by_id = ctx.tree.nodes
    parent, up = None, 0  # the last parent met and its text key (siblings come together)
    for n, v in zip(nodes, values):  # the pair a text key interns: equal pairs, equal keys
        if n.parent is None:
            key = 0
        else:
            if n.parent != parent:
                parent, up = n.parent, text_key(ctx, nodes_by_id[n.parent])
            key = (up, step_text(n))
        out.append(0.0 if key in seen else v)
        seen.add(key)
    return out


def last_step_values(nodes: Sequence[Node], values: Sequence[float]) -> list[float]:
    """ToT's last-step rule (``value_outputs_unwrap``): a finished state that gave no answer
    (cut by a step or depth limit) is valued 0; answer states keep their judged value."""
    return [0.0 if n.terminal and not answered(n) else v for n, v in zip(nodes, values)]


def best_answer(ctx) -> Node | None:
    """The best-valued finished node, else the best-valued node, else None."""
    values: dict[int, float] = ctx.values
    nodes = [ctx.tree.nodes[i] for i in values]
    done = [n for n in nodes if n.terminal and n.status != FAILED]
    pool = done or nodes
    return max(pool, key=lambda n: values[n.id]) if pool else None
