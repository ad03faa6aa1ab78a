"""DFSDT, the depth-first search-based decision tree of ToolLLM (Qin et al., ICLR 2024,
"ToolLLM: Facilitating Large Language Models to Master 16000+ Real-world APIs").

    stack <- [root]
    while stack:
        node <- top of stack
        if node is finished:
            stop=success: stop if the env reports success (verifier in the loop), else back up
                          `back` levels (ToolBench backs up 2 after a give-up, and after an
                          answer when it wants more answers)
            stop=answer:  stop at the first answer state (ToolBench's give_answer), whatever
                          it is; a branch cut by a step or depth limit backs up one level
        elif node already has `width` children: back up one level
        else: generate one child, showing the previously tried children in the prompt so it
              tries something different; push it
    answer <- the first success (or answer), else the last finished attempt

ToolBench stops at the first final answer the model gives, unchecked (``stop=answer``). Its
envs never say an answer was wrong; ours end a lost episode and say so, and stopping there
would make DFSDT a single chain on envs whose every episode ends in an answer, so the default
``stop=success`` backs out of a lost ending as ToolBench backs out of a give-up; it consults
the env's success check, so its results are flagged ``verifier_in_loop``. Knobs: ``width``
(children tried per node before backtracking; ToolBench's ``tree_beam_size``, 2), ``stop``
(success | answer), ``back`` (levels backed up from a lost ending; ToolBench's
``prune_back_length``, 2), ``dedup`` (state | text | none: a child repeating a sibling is not
descended into), ``temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import FAILED

from .values import answered, check_dedup, dedup_nodes, engine_dedup, text_key

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext


def diversity_note(ctx, node) -> str:
    """The ToolLLM-style reminder of the actions already tried from this state."""
    lines = []
    for c in (ctx.tree.nodes[i] for i in node.children):
        outcome = c.observation.strip().splitlines()[-1] if c.observation.strip() else ""
        lines.append(f"- {c.step.action or '(invalid)'} -> {outcome[:120]}")
    return ("This is not your first try from this state; these earlier attempts did not "
            "succeed:\n" + "\n".join(lines) + "\nChoose an action different from all of them.")


@register_strategy("dfsdt")
@dataclass
class DFSDT(Strategy):
    width: int = 2
    stop: str = "success"
    back: int = 2
    dedup: str = "state"
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.width < 1 or self.back < 1:
            raise ValueError(f"width and back must be >= 1, got width={self.width}, back={self.back}")
        if self.stop not in ("success", "answer"):
            raise ValueError(f"stop must be success or answer, got {self.stop!r}")
        check_dedup(self.dedup)
        self.verifier_in_loop = self.stop == "success"

    async def run(self, ctx: SearchContext) -> None:
        stack = [ctx.root]
        while stack:
            node = stack[-1]
            if not ctx.expandable(node):
                if self._done(ctx, node):
                    ctx.answer = node
                    return
                lost = self.stop == "success" and answered(node)  # a lost ending: give up here
                del stack[-(self.back if lost else 1):]
            elif len(node.children) >= self.width:
                stack.pop()  # every allowed child tried: backtrack
            else:
                note = diversity_note(ctx, node) if node.children else ""
                seen = ({text_key(ctx, ctx.tree.nodes[c]) for c in node.children}
                        if self.dedup == "text" else None)
                (kids,) = await ctx.expand([node], 1, temperature=self.temperature,
                                           dedup=engine_dedup(self.dedup), notes=[note])
                stack += dedup_nodes(ctx, kids, "text", seen) if seen is not None else kids

    def _done(self, ctx, node) -> bool:
        """Whether the search stops at this finished node."""
        if self.stop == "answer":
            return answered(node)
        return node.status != FAILED and ctx.verify(node)

    def select(self, ctx: SearchContext):
        if ctx.answer is not None:
            return ctx.answer
        finished = [n for n in ctx.tree.nodes if n.terminal and n.status != FAILED]
        return finished[-1] if finished else None
