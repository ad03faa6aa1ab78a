"""Children: one job, turning an answered op into what its strategy is sent (docs/design.md §5).

Each request's answer is checked (:func:`~omrl_search.batching.well_formed`: a malformed
generation, NaN/+inf logprobs included, is a fault of its node) and charged to its search's
budget (:meth:`~omrl_search.budget.Budget.charge_lm`). An expansion's usable generations are then
parsed by the agent format and, if well formed, stepped in the env: the node's children. An
ask's are its texts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .batching import Crashed, LMWait, well_formed
from .ops import AskOp
from .requests import SKIPPED
from .tree import EXPANDED, TERMINAL, Node, dedup_key, unique_states
from .types import Generation

if TYPE_CHECKING:  # pragma: no cover
    from .constrain import Grammar
    from .ops import SearchContext


def answer_or_crash(wait: LMWait) -> Any:
    """:func:`answer`, or :class:`~omrl_search.batching.Crashed` (the search's end) if building
    it failed (MemoryError included)."""
    try:
        return answer(wait)
    except Exception as exc:
        return Crashed(exc)


def answer(wait: LMWait) -> list:
    """An answered expand's children per node, or an answered ask's texts per prompt."""
    op = wait.op
    ctx = op.ctx
    if type(op) is AskOp:
        return [[g.text for g in gens] if (gens := usable(ctx, raw, op.n)) is not None else []
                for raw in wait.gens]
    out = []
    for node, work, raw in zip(op.nodes, wait.work, wait.gens):
        if raw is SKIPPED:
            out.append([])
            continue
        context_ids, grammar = work
        gens = usable(ctx, raw, op.k)
        if node.status != TERMINAL:
            node.status = EXPANDED
        if gens is not None and ctx.constraint is not None:
            ctx.constraint.count(gens, grammar)
        out.append([] if gens is None else children(ctx, node, context_ids, gens, op.dedup, grammar))
    return out


def usable(ctx: "SearchContext", gens: Any, n: int) -> list[Generation] | None:
    """A request's answer, its well-formed generations charged to its search's budget; a failed
    request, each malformed generation and a short answer are faults. None when nothing usable
    came back."""
    if isinstance(gens, Exception):
        ctx.budget.charge_lm()
        ctx.faults.append(f"lm: {type(gens).__name__}: {gens}")
        return None
    good, problems = well_formed(gens, n)
    ctx.budget.charge_lm(good)
    if problems:
        ctx.faults += (f"lm: {p}" for p in problems)
    return good or None


def children(ctx: "SearchContext", node: Node, context_ids: list[int] | None,
             gens: list[Generation], dedup: bool, grammar: "Grammar | None" = None) -> list[Node]:
    """``node``'s children from ``gens``: each completion parsed by the agent format and, if
    well formed, stepped in the env; with ``dedup`` a child repeating a sibling's state (by
    :func:`~omrl_search.tree.dedup_key`) is pruned and left out. A completion generated under
    ``grammar`` (its ``constraint`` not "none") records it in ``Step.grammar`` as a plain dict,
    for trainers to rebuild the masks."""
    seen = {dedup_key(ctx.tree.nodes[c]) for c in node.children} if dedup else None
    prompts, envs = ctx.prompts, ctx.envs
    fields = grammar.to_record() if grammar is not None else None
    kids = []
    for gen in gens:
        step, error = prompts.parse(gen, context_ids)
        if fields is not None and gen.constraint != "none":
            step.grammar = dict(fields)
        kids.append(envs.invalid(node, step, error) if error else envs.step(node, step))
    return kids if seen is None else unique_states(kids, seen, keep_failed=True)


def children_of_texts(ctx: "SearchContext", node: Node, completions: list[str], dedup: bool) -> list[Node]:
    """Children from given completion texts (no LM call, nothing charged but env steps)."""
    prompts = ctx.prompts
    context_ids = prompts.context_ids(node)
    gens = [Generation(text=text, token_ids=prompts.encode(text), logprobs=None,
                       prompt_tokens=0, completion_tokens=0) for text in completions]
    if node.status != TERMINAL:
        node.status = EXPANDED
    return children(ctx, node, context_ids, gens, dedup)
