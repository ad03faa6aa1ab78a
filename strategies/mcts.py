"""Monte-Carlo tree search with PUCT (Silver et al., Nature 2017, AlphaGo Zero) or UCT, as used
for LM agents by LATS (Zhou et al., ICML 2024, "Language Agent Tree Search"), rStar (Qi et al.
2024) and rStar-Math (Guan et al. 2025), batched over many leaves per round with virtual loss.

    repeat until the budget or `simulations` run out:
        select up to `leaves` leaves, each by descending along the PUCT argmax
            Q(c) + c_puct * P(c) * sqrt(N(parent)) / (1 + N(c)),
        or (rule=uct, LATS and rStar) an unvisited child first, else the UCT argmax
            Q(c) + c_puct * sqrt(ln N(parent) / N(c)),
        adding a virtual loss along the path so the next descent goes elsewhere
        expand all selected leaves in ONE LM call, k children each
            (priors P: softmax of the children's logprobs, or uniform;
             progressive widening lets a node grow to k * N^widen children;
             priors=policy: a leaf whose env lists at most max_actions valid actions gets a
             child for every one, P the softmax of the policy's score of each, all leaves'
             actions scored in one batched call instead of sampling k)
        evaluate: every new child (PRM, heuristic, LM, logprob), or the most probable new
            child by a rollout to a terminal, or (1 - lam) * PRM + lam * rollout
            (evaluate=best: only the most probable new child for any value, AlphaZero's one
             evaluation per simulation; the others keep their priors until chosen)
        (a finished leaf chosen again is not valued again: its first value is backed up at
         once, without a virtual loss or a place in the round's LM call)
        remove the virtual losses and back the values up to the root
        (stop_on_success, LATS) stop once a valued node or its rollout ends solved
        (reflect) after a failed terminal, write a LATS-style reflection for later prompts
    answer: (stop_on_success or solver) the first solved end reached, else follow the most
        visited (final=visits) or best-valued (final=value) children

Knobs: ``simulations``, ``leaves``, ``k``, ``c_puct``, ``priors`` (logprob | uniform | policy),
``max_actions`` (priors=policy: the most valid actions a leaf may list to be scored whole),
``value``
(auto | rm | rollout | mix | heuristic | lm | logprob; auto = rm with a reward model, else the
env heuristic, else rollout), ``evaluate`` (auto | all | best: which new children are valued;
auto = best for the costly rollout and mix, all otherwise), ``lam``, ``widen`` (0 = off),
``reflect``, ``final``, ``temperature``, ``rule`` (puct | uct), ``stop_on_success``, ``solver``
(MCTS-Solver: a failed finished leaf leaves the selection once backed up). Rollouts,
reflections on failures, ``solver`` and ``stop_on_success`` consult the env's success check:
such results are flagged ``verifier_in_loop``. How this reads against LATS and rStar:
docs/strategies.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omrl_search.strategy import Strategy, register_strategy
from omrl_search.tree import FAILED, PRUNED, Node
from omrl_search.types import DEFAULT_MAX_TOKENS

from .values import (Mix, RMValue, RolloutValue, check_value, history, make_value, scored_actions,
                     softmax, step_logprob)

if TYPE_CHECKING:  # pragma: no cover
    from omrl_search.ops import SearchContext

REFLECT_PROMPT = (
    "You attempted this task and failed.\n\nTask: {task}\n\nYour steps:\n{history}\n\n"
    "Final observation:\n{state}\n\nIn two or three sentences, say what went wrong and give a "
    "short plan that avoids it."
)


def _won(ctx, node) -> bool:
    """A finished node the env's success check passes (consulting it flags the result)."""
    return node.terminal and node.status != FAILED and ctx.verify(node)


@dataclass(slots=True)
class MCTSState:
    """One MCTS search's own state (``ctx.state``), beside the statistics every node carries
    (``visits``, ``value_sum``, ``prior``: part of the saved tree)."""

    #: each expanded node's live children (dead ends dropped), by node id
    kids: dict[int, list[Node]] = field(default_factory=dict)
    #: nodes whose widening found nothing new
    closed: set[int] = field(default_factory=set)
    #: dead ends: nothing left to try below them
    dead: set[int] = field(default_factory=set)
    #: simulations done
    sims: int = 0
    #: reflections on failed attempts (``reflect=true``), oldest first
    reflections: list[str] = field(default_factory=list)
    #: ``priors=policy``: each child's score under the policy, by node id
    prior: dict[int, float] = field(default_factory=dict)
    #: the value of each finished leaf, valued once, by node id
    finished: dict[int, float] = field(default_factory=dict)
    #: a solved end found (LATS's stop), the answer
    solved: Node | None = None


@register_strategy("mcts")
@dataclass
class MCTS(Strategy):
    simulations: int = 64
    leaves: int = 4
    k: int = 3
    c_puct: float = 1.0
    priors: str = "logprob"
    max_actions: int = 32
    value: Any = "auto"
    evaluate: str = "auto"
    lam: float = 0.5
    widen: float = 0.0
    reflect: bool = False
    final: str = "visits"
    temperature: float | None = None
    rule: str = "puct"
    stop_on_success: bool = False
    solver: bool = False

    def __post_init__(self) -> None:
        if self.simulations < 1 or self.leaves < 1 or self.k < 1:
            raise ValueError("simulations, leaves and k must be >= 1")
        if self.priors not in ("logprob", "uniform", "policy") or self.final not in ("visits", "value"):
            raise ValueError("priors must be logprob|uniform|policy and final visits|value")
        if self.evaluate not in ("auto", "all", "best"):
            raise ValueError(f"evaluate must be auto, all or best, got {self.evaluate!r}")
        if self.rule not in ("puct", "uct"):
            raise ValueError(f"rule must be puct or uct, got {self.rule!r}")
        if self.max_actions < 1:
            raise ValueError(f"max_actions must be >= 1, got {self.max_actions}")
        if not 0.0 <= self.lam <= 1.0 or self.widen < 0 or self.c_puct < 0:
            raise ValueError("need 0 <= lam <= 1, widen >= 0 and c_puct >= 0")
        check_value(self.value, ("auto", "rm", "rollout", "mix", "heuristic", "lm", "logprob"))

    def _value(self, ctx):
        spec = self.value
        if spec == "auto":
            spec = "rm" if ctx.has_reward_model else "heuristic" if ctx.has_heuristic else "rollout"
        if spec == "mix":
            return Mix(RMValue(), RolloutValue(self.temperature), self.lam)
        if spec == "rollout":
            return RolloutValue(self.temperature)
        return make_value(spec, ctx)

    async def run(self, ctx: SearchContext) -> None:
        value = self._value(ctx)
        one_child = self.evaluate == "best" or (  # costly values: one child per leaf
            self.evaluate == "auto" and isinstance(value, (RolloutValue, Mix)))
        if self.priors == "policy" and not ctx.can_score:
            raise ValueError(f"mcts:priors=policy needs a policy that scores completions "
                             f"(Policy.score); {ctx.policy_name!r} does not")
        s = ctx.state = MCTSState()
        finished = s.finished  # the value of each finished leaf, by id: valued once
        while s.sims < self.simulations:
            batch, paths = self._select_batch(ctx)
            if not batch:
                return
            grow = [leaf for leaf in batch if not leaf.terminal]
            try:
                if grow:
                    notes = [self._note(ctx)] * len(grow) if s.reflections else None
                    kids = await self._grow(ctx, grow, notes)
                else:  # only finished leaves: no LM call, but the budget still ends the search
                    ctx.check()
                    kids = []
            finally:
                for path in paths:  # remove the virtual losses
                    for n in path:
                        n.visits -= 1
            targets = [leaf for leaf in batch if leaf.terminal]
            dead = []
            for leaf, new in zip(grow, kids):
                if not new and leaf.id in s.kids:
                    s.closed.add(leaf.id)  # widening found nothing new
                live = self._set_children(ctx, leaf)
                if new:
                    targets += [max(new, key=lambda c: c.prior)] if one_child else new
                elif not live:
                    self._kill(ctx, leaf)
                    dead.append(leaf)  # a dead end: backed up as a 0
            # every target is valued here for the first time: a finished leaf valued before
            # never reaches the batch (_select_batch backs it up at once)
            values = await value(ctx, targets) if targets else []
            for t, v in zip(targets, values):
                if t.terminal:
                    finished[t.id] = v
            self._backup(ctx, list(zip(targets, values)) + [(t, 0.0) for t in dead])
            if self.solver:
                self._close_lost(ctx, targets)
            if self.stop_on_success and self._solved(ctx, targets):
                return
            if self.reflect and targets:
                await self._reflect(ctx, targets)

    def _close_lost(self, ctx, targets) -> None:
        """MCTS-Solver (Winands, Bjornsson and Saito 2008), for envs whose ends are final: a
        finished leaf that did not succeed is a proven loss once backed up, so it leaves the
        selection (and a node whose children are all closed becomes a dead end in
        :meth:`_descend`). Simulations then go to what is still unknown instead of re-choosing
        a known failure, which PUCT does for as long as the policy's prior on it dominates."""
        for t in targets:
            if t.terminal and t.id in ctx.state.finished and not ctx.verify(t):
                self._kill(ctx, t)

    @staticmethod
    def _solved(ctx, targets) -> bool:
        """LATS's stop: a node valued this round, or the end of its rollout, is a solved
        terminal (the env's success check: flags the result); remembered for :meth:`select`."""
        rollout = ctx.rollout_leaves
        for t in targets:
            end = ctx.tree.nodes[rollout.get(t.id, t.id)]
            if _won(ctx, end):
                ctx.state.solved = end
                return True
        return False

    async def _grow(self, ctx, grow, notes):
        """New children of each leaf: k samples, or (priors=policy) one per valid action of a
        leaf that lists few, scored by the policy in one call."""
        if self.priors != "policy":
            return await ctx.expand(grow, self.k, temperature=self.temperature, dedup=True, notes=notes)
        s = ctx.state
        scored = await scored_actions(ctx, [n for n in grow if n.id not in s.closed], self.max_actions)
        sample = [j for j, n in enumerate(grow) if n.id not in scored]
        kids = [[] for _ in grow]
        if sample:
            got = await ctx.expand([grow[j] for j in sample], self.k, temperature=self.temperature,
                                   dedup=True, notes=[notes[j] for j in sample] if notes else None)
            for j, new in zip(sample, got):
                kids[j] = new
        for j, leaf in enumerate(grow):
            if leaf.id in scored:
                by_text = dict(scored[leaf.id])
                new = ctx.apply(leaf, list(by_text))
                for c in new:
                    s.prior[c.id] = by_text.get(c.step.completion, -math.inf)
                s.closed.add(leaf.id)  # every action is a child: nothing left to widen into
                kids[j] = new
        return kids

    # --- selection -----------------------------------------------------------------------------
    def _select_batch(self, ctx) -> tuple[list, list]:
        """Up to ``leaves`` distinct leaves; a descent that reaches an already chosen leaf (a
        collision) keeps its virtual loss, which steers the following descents elsewhere. A
        descent that reaches a finished leaf valued before is its whole simulation: the value
        is backed up along the path at once and the descent does not take a leaf's place."""
        batch, paths, chosen = [], [], set()
        s = ctx.state
        finished, tries = s.finished, 0
        while tries < self.leaves:
            found = self._descend(ctx)
            if found is None:
                break
            leaf, path = found
            v = finished.get(leaf.id)
            if v is not None:  # a finished leaf, valued before: its simulation is done now,
                for n in path:  # the descent's visit made real with its value (no LM, no wait)
                    n.value_sum += v
                s.sims += 1
                if s.sims >= self.simulations:
                    break
                continue
            tries += 1
            paths.append(path)
            if leaf.id not in chosen:
                chosen.add(leaf.id)
                batch.append(leaf)
        return batch, paths

    def _descend(self, ctx):
        """One PUCT descent from the root with a virtual loss on its path; None when every
        branch is a dead end. (The hot loop of a search: locals only, no calls per child.)"""
        kids_of, dead, root = ctx.state.kids, ctx.state.dead, ctx.tree.nodes[0]
        c_puct, sqrt, widens = self.c_puct, math.sqrt, self._widens if self.widen else None
        uct, log = self.rule == "uct", math.log
        while root.id not in dead:
            node, path = root, [root]
            while not node.terminal and not (widens and widens(ctx, node)):
                kids = kids_of.get(node.id)
                if not kids:  # None: not expanded yet, the leaf; []: a dead end
                    break
                visits = node.visits
                best, top = None, -math.inf
                if uct:  # UCT (LATS, rStar): an unvisited child first, in order
                    ln = log(visits or 1)
                    for c in kids:
                        n = c.visits
                        if not n:
                            best = c
                            break
                        score = c.value_sum / n + c_puct * sqrt(ln / n)
                        if score > top:
                            best, top = c, score
                else:
                    explore = c_puct * sqrt(visits or 1)
                    fpu = node.value_sum / visits if visits else 0.0
                    for c in kids:
                        n = c.visits
                        score = (c.value_sum / n if n else fpu) + explore * c.prior / (1 + n)
                        if score > top:
                            best, top = c, score
                node = best
                path.append(node)
            if kids_of.get(node.id) == [] and not (widens and widens(ctx, node)):
                self._kill(ctx, node)
                continue
            for n in path:
                n.visits += 1  # virtual loss: a visit worth 0
            return node, path
        return None

    def _kill(self, ctx, node) -> None:
        """A node with nothing left to try: drop it from its parent's children."""
        ctx.state.dead.add(node.id)
        if node.parent is not None:
            siblings = ctx.state.kids.get(node.parent)
            if siblings is not None and node in siblings:
                siblings.remove(node)

    def _widens(self, ctx, node) -> bool:
        s = ctx.state
        if not self.widen or node.id in s.closed or node.id not in s.kids:
            return False
        return len(s.kids[node.id]) < self.k * max(node.visits, 1) ** self.widen

    def _set_children(self, ctx, node) -> list:
        """Record the node's live children and set their priors."""
        dead = ctx.state.dead
        kids = [c for c in (ctx.tree.nodes[i] for i in node.children)
                if c.status != PRUNED and c.status != FAILED and c.id not in dead]
        ctx.state.kids[node.id] = kids
        if self.priors == "uniform":
            for c in kids:
                c.prior = 1.0 / len(kids)
            return kids
        scored = ctx.state.prior
        lps = [scored[c.id] if c.id in scored else step_logprob(c) for c in kids]
        for c, p in zip(kids, softmax(lps)):
            c.prior = p
        return kids

    # --- backup and reflection -----------------------------------------------------------------
    def _backup(self, ctx, pairs) -> None:
        """Back ``(node, value)`` pairs up to the root, in order. A run of siblings shares one
        walk above their parent, each ancestor adding their values in the same order as one
        walk per node would (so the sums, and the tree, are the same to the last bit)."""
        ctx.state.sims += len(pairs)
        nodes, i, end = ctx.tree.nodes, 0, len(pairs)
        while i < end:
            node, v = pairs[i]
            node.visits += 1
            node.value_sum += v
            parent, values = node.parent, [v]
            i += 1
            while i < end and parent is not None and pairs[i][0].parent == parent:
                node, v = pairs[i]
                node.visits += 1
                node.value_sum += v
                values.append(v)
                i += 1
            k = len(values)
            while parent is not None:  # up the tree edges to the root
                node = nodes[parent]
                node.visits += k
                for v in values:
                    node.value_sum += v
                parent = node.parent

    def _note(self, ctx) -> str:
        return "Reflections on earlier failed attempts:\n" + "\n".join(
            f"- {r}" for r in ctx.state.reflections[-3:])

    async def _reflect(self, ctx, targets) -> None:
        rollout = ctx.rollout_leaves
        ends = [ctx.tree.nodes[rollout.get(t.id, t.id)] for t in targets]
        failed = [e for e in ends if e.terminal and e.status != FAILED and not ctx.verify(e)]
        if not failed:
            return
        end = failed[0]  # one reflection per round
        if ctx.can_ask:
            prompt = REFLECT_PROMPT.format(task=ctx.task.instruction, history=history(ctx, end),
                                           state=end.observation)
            (texts,) = await ctx.ask([end], [prompt], max_tokens=DEFAULT_MAX_TOKENS)
            text = " ".join((texts[0] if texts else "").split())
        else:  # a policy that only picks actions: record the failed attempt itself
            text = f"the steps {history(ctx, end).replace(chr(10), ' ')} ended with: " \
                   f"{end.observation.strip().splitlines()[-1]}"
        if text:
            ctx.state.reflections.append(text)

    # --- the answer ----------------------------------------------------------------------------
    def select(self, ctx: SearchContext):
        s = ctx.state if isinstance(ctx.state, MCTSState) else MCTSState()  # none: not started
        if s.solved is None and (self.stop_on_success or self.solver):
            # a search that consults the success check answers with the first win it reached,
            # also one it went on past (stop_on_success=false) or found in the round the
            # budget ended (a rollout that ran out mid-round never reached the stop test)
            s.solved = next((n for n in ctx.tree.nodes if _won(ctx, n)), None)
        if s.solved is not None:
            return s.solved
        key = ((lambda c: (c.visits, c.value)) if self.final == "visits"
               else (lambda c: (c.value, c.visits)))
        node, dead = ctx.root, s.dead
        while True:
            kids = [c for c in (ctx.tree.nodes[i] for i in node.children)
                    if c.visits > 0 and c.status not in (PRUNED, FAILED) and c.id not in dead]
            if not kids:
                break
            node = max(kids, key=key)
        if node.terminal:
            return node
        leaf = ctx.rollout_leaves.get(node.id)
        if leaf is not None:
            return ctx.tree.nodes[leaf]
        done = [n for n in ctx.tree.nodes if n.terminal and n.visits > 0 and n.status != FAILED]
        return max(done, key=key) if done else (node if node is not ctx.root else None)
