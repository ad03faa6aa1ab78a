"""DFSDT, the depth-first search-based decision tree of ToolLLM (Qin et al., ICLR 2024,
"ToolLLM: Facilitating Large Language Models to Master 16000+ Real-world APIs").

    stack <- [root]
    while stack:
        node <- top of stack
        if node is finished: stop on success, else backtrack (pop)
        elif node already has `width` children: backtrack (pop)
        else: generate one child, showing the previously tried children in the prompt so it
              tries something different; push it
    answer <- the first success, else the last finished attempt

Stopping at the first success consults the env's success check by the paper's design, so
results are flagged ``verifier_in_loop``. Knobs: ``width`` (children tried per node before
backtracking), ``temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass

from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import FAILED


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
    temperature: float | None = None
    verifier_in_loop = True

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")

    async def run(self, ctx) -> None:
        stack = [ctx.root]
        while stack:
            node = stack[-1]
            if not ctx.expandable(node):
                if node.status != FAILED and ctx.verify(node):
                    ctx.scratch["answer"] = node
                    return
                stack.pop()  # failed or given up: backtrack
            elif len(node.children) >= self.width:
                stack.pop()  # every allowed child tried: backtrack
            else:
                note = diversity_note(ctx, node) if node.children else ""
                (kids,) = await ctx.expand([node], 1, temperature=self.temperature, dedup=True,
                                           notes=[note])
                stack += kids

    def select(self, ctx):
        if "answer" in ctx.scratch:
            return ctx.scratch["answer"]
        finished = [n for n in ctx.tree.nodes if n.terminal and n.status != FAILED]
        return finished[-1] if finished else None
