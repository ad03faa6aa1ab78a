"""What a strategy sees of one search: :class:`SearchContext`, its batched primitives, and the
typed records (:class:`ExpandOp`, :class:`AskOp`, :class:`EvaluateOp`) they hand the engine.

The primitives that need the LM or the reward model (``expand``, ``ask``, ``score_actions``,
``evaluate``) do not call anything themselves: they yield an op record to the engine's driver,
which serves every tree's pending ops of a round together (one policy call for all expansions
*and* asks, one ``Policy.score`` call for all scorings, one reward-model call for all
evaluations) and resumes the strategies. ``apply``, ``valid_actions`` and ``heuristic`` touch
only the env and run at once. Every primitive checks the budget *before* its batch and raises
:class:`~omrl_search.budget.BudgetExhausted` when it is spent, so a search overshoots a limit by
at most one batch (see docs/design.md §4); the engine's caps on nodes per tree and faults per
search (:class:`~omrl_search.budget.CapReached`) are checked the same way.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from .budget import CapReached
from .tree import FAILED, Node, SearchTree
from .types import Task

if TYPE_CHECKING:  # pragma: no cover
    from .budget import Budget
    from .engine import Engine
    from .env_driver import EnvDriver
    from .prompts import Constraint, Prompts


class Op:
    """An operation a strategy waits on: ``await op`` yields it to the engine's driver, which
    sends back the result."""

    __slots__ = ()
    ctx: "SearchContext"

    def __await__(self):
        return (yield self)


@dataclass(slots=True)
class ExpandOp(Op):
    """Sample ``k`` agent steps at each of ``nodes`` and step the env: children per node."""

    ctx: "SearchContext"
    nodes: list[Node]
    k: int
    temperature: float | None
    dedup: bool
    notes: Sequence[str] | None


@dataclass(slots=True)
class AskOp(Op):
    """Free-form prompts about ``nodes``: ``n`` texts per prompt."""

    ctx: "SearchContext"
    nodes: list[Node]
    prompts: list[Any]
    n: int
    temperature: float | None
    max_tokens: int | None
    stop: tuple[str, ...]


@dataclass(slots=True)
class ScoreOp(Op):
    """The policy's total logprob of each of ``completions[j]`` after ``nodes[j]``'s prompt."""

    ctx: "SearchContext"
    nodes: list[Node]
    completions: list[list[str]]


@dataclass(slots=True)
class EvaluateOp(Op):
    """Reward-model values of the paths ending at ``nodes``."""

    ctx: "SearchContext"
    nodes: list[Node]
    aggregation: str | None


class Seeds:
    """One search's request seeds: ``step(node, call)`` is ``engine.mix_seed(seed, node, call)`` and
    ``ask(node, call)`` is ``engine.mix_seed(seed, "ask", node, call)`` for ints, computed from a
    copy of the hash state after the seed's part (the same bits, half the cost per request)."""

    __slots__ = ("_base",)

    def __init__(self, seed: int):
        self._base = hashlib.blake2b(f"({seed!r}, ".encode(), digest_size=8)

    def _tail(self, tail: str) -> int:
        h = self._base.copy()
        h.update(tail.encode())
        return int.from_bytes(h.digest(), "big") >> 1

    def step(self, node: int, call: int) -> int:
        return self._tail(f"{node!r}, {call!r})")

    def ask(self, node: int, call: int) -> int:
        return self._tail(f"'ask', {node!r}, {call!r})")


class SearchContext:
    """One search: its task, tree, budget, RNG, per-search state and the primitives.

    One strategy instance serves many searches, so per-search state never lives on the
    strategy. A strategy keeps its own in ``state``, a typed object it makes at the start of
    ``run`` (MCTS: :class:`strategies.mcts.MCTSState`). What strategies and value sources
    share has typed fields here: ``values`` (node id -> the last value given it), ``rollout_leaves``
    (node id -> the id of the finished leaf a rollout from it reached), ``value_caches`` (per value
    source, its cache), ``text_keys`` (ToT's repeat rule) and ``answer`` (the answer step a
    strategy settled on). ``scratch`` is a free dict for users' own strategies; ours do not use
    it. ``envs`` steps the
    search's env (:class:`~omrl_search.env_driver.EnvDriver`), ``prompts`` builds what the
    policy is shown (:class:`~omrl_search.prompts.Prompts`); strategies use the primitives.
    """

    def __init__(self, engine: "Engine", task: Task, tree: SearchTree, budget: "Budget", seed: int,
                 envs: "EnvDriver", prompts: "Prompts", constraint: "Constraint | None" = None):
        self.engine, self.task, self.tree, self.budget = engine, task, tree, budget
        self.envs, self.prompts, self.constraint = envs, prompts, constraint
        self.env = envs.env
        self.seed = seed
        self.seeds = Seeds(seed)  # each LM request's seed, from the search's seed
        self.max_depth = envs.max_depth
        self.faults: list[str] = envs.faults
        self.calls = 0  # LM requests made so far (part of each request's seed)
        self.has_reward_model = engine.reward_model is not None
        self.state: Any = None  # the strategy's own typed per-search state
        self.values: dict[int, float] = {}
        self.rollout_leaves: dict[int, int] = {}
        self.value_caches: dict[tuple, dict] = {}
        self.text_keys: tuple[dict, dict] | None = None
        self.answer: Node | None = None
        self.scratch: dict[str, Any] = {}
        self.verifier_used = False  # set when the env's success check was consulted
        self.max_nodes: int | None = getattr(engine, "max_nodes", None)
        self.max_faults: int | None = getattr(engine, "max_faults", None)

    @property
    def policy_name(self) -> str:
        """The policy's name, for a strategy's messages (strategies never reach the policy)."""
        return self.engine.policy.name

    @cached_property
    def rng(self) -> random.Random:
        """The search's own RNG, seeded from its seed; made on first use (most strategies draw
        nothing here: their randomness is the LM's, seeded per request)."""
        return random.Random(self.seed)

    def check(self, kinds: tuple[str, ...] | None = None) -> None:
        """Raise when the budget (of ``kinds``) is spent or, for primitives that grow the tree
        (``kinds`` None), a cap is reached: before every batch."""
        if kinds is not None:
            self.budget.check(kinds)
            return
        self.budget.check()
        if self.max_nodes is not None and len(self.tree.nodes) >= self.max_nodes:
            raise CapReached(f"nodes={self.max_nodes}")
        if self.max_faults is not None and len(self.faults) >= self.max_faults:
            raise CapReached(f"faults={self.max_faults}")

    # --- batched LM / reward-model primitives ------------------------------------------------
    async def expand(self, nodes: Sequence[Node], k: int = 1, *, temperature: float | None = None,
                     dedup: bool = False, notes: Sequence[str] | None = None) -> list[list[Node]]:
        """Sample ``k`` completions at each node, step the env for each, return the children.

        ``notes`` adds text to each node's prompt (e.g. DFSDT's previously tried siblings).
        With ``dedup`` a child whose dedup key (``Env.dedup_key``, by default the state key) equals an existing sibling's is kept in the tree
        as pruned and not returned (:func:`~omrl_search.tree.unique_states`).
        """
        self.check()
        if not nodes:
            return []
        return await ExpandOp(self, list(nodes), k, temperature, dedup, notes)

    async def ask(self, nodes: Sequence[Node], prompts: Sequence[Any], *, n: int = 1,
                  temperature: float | None = None, max_tokens: int | None = None,
                  stop: Sequence[str] = ()) -> list[list[str]]:
        """Raw LM prompts (a string or chat messages each) about ``nodes``; ``n`` texts each.

        For LM self-evaluation, proposal lists and reflections. Served in the same policy call
        as the round's expansions and charged like them. Needs a policy that answers free-form
        prompts (:attr:`can_ask`); scripted policies only pick env actions.
        """
        if not self.can_ask:
            raise RuntimeError(f"policy {self.engine.policy.name!r} does not answer free-form prompts")
        self.check()
        if not nodes:
            return []
        return await AskOp(self, list(nodes), list(prompts), n, temperature, max_tokens, tuple(stop))

    async def evaluate(self, nodes: Sequence[Node], *, aggregation: str | None = None) -> list[float]:
        """Reward-model values of the paths ending at ``nodes`` (stored in ``node.score``);
        per-step scores reduced by ``aggregation`` (default: the reward model's own).

        Only the limits an evaluation spends (``rm_calls``, ``rm_tokens``, ``seconds``) stop it: scoring what
        a spent token budget already paid for (best-of-N's samples) is what a search is for."""
        if self.engine.reward_model is None:
            raise RuntimeError("evaluate() needs a reward model")
        self.check(("rm_calls", "rm_tokens", "seconds"))
        if not nodes:
            return []
        return await EvaluateOp(self, list(nodes), aggregation)

    async def score_actions(self, nodes: Sequence[Node], completions: Sequence[Sequence[str]]
                            ) -> list[list[float]]:
        """The policy's total logprob of each completion text in ``completions[j]`` as the
        next step at ``nodes[j]`` (one ``Policy.score`` call over every pending scoring, each
        node's prompt shared by its completions). For policy priors over a few valid actions
        (``mcts:priors=policy``); charged one LM call and the tokens read per node. Needs a
        policy that scores (:attr:`can_score`)."""
        if not self.can_score:
            raise RuntimeError(f"policy {self.engine.policy.name!r} does not score completions "
                               f"(it has no Policy.score)")
        self.check()
        if not nodes:
            return []
        return await ScoreOp(self, list(nodes), [list(c) for c in completions])

    async def rollout(self, nodes: Sequence[Node], *, temperature: float | None = None) -> list[Node]:
        """Extend each node one sampled step at a time until terminal; return the leaves."""
        leaves: list[Node | None] = [n if not self.expandable(n) else None for n in nodes]
        frontier = [(i, n) for i, n in enumerate(nodes) if leaves[i] is None]
        while frontier:
            kids = await self.expand([n for _, n in frontier], 1, temperature=temperature)
            nxt = []
            for (i, n), ch in zip(frontier, kids):
                child = ch[0] if ch else n
                if ch and self.expandable(child):
                    nxt.append((i, child))
                else:
                    leaves[i] = child
            frontier = nxt
        return leaves  # type: ignore[return-value]

    # --- env-only primitives (run at once, no LM) ---------------------------------------------
    def apply(self, node: Node, completions: Sequence[str], *, dedup: bool = True) -> list[Node]:
        """Children of ``node`` from given completion texts (e.g. steps an LM listed in one
        ``ask``), each stepped in the env after restoring ``node``'s snapshot."""
        self.check()
        return self.engine.apply(self, node, list(completions), dedup)

    def valid_actions(self, node: Node) -> list[str] | None:
        """The env's ``valid_actions()`` at ``node``'s state (None when it does not list them),
        asked once per node."""
        listed = self.envs.valid_actions(node)
        return None if listed is None else list(listed)

    @property
    def has_heuristic(self) -> bool:
        return callable(getattr(self.env, "heuristic", None))

    def heuristic(self, nodes: Sequence[Node]) -> list[float]:
        """The env's own ``heuristic()`` of each node's state (envs that offer one)."""
        return self.envs.heuristic(list(nodes))

    def verify(self, node: Node) -> bool:
        """The env's success check of a node. Consulting it marks the result
        ``verifier_in_loop``: the search was steered or chosen by the env's own verifier."""
        self.verifier_used = True
        return node.success

    # --- helpers ------------------------------------------------------------------------------
    @property
    def can_ask(self) -> bool:
        return self.engine.answers_prompts

    @property
    def can_score(self) -> bool:
        """Whether the policy scores given completions: its ``can_score`` flag when it has one,
        else whether it has a ``score`` method."""
        policy = self.engine.policy
        flag = getattr(policy, "can_score", None)
        return bool(flag) if flag is not None else callable(getattr(policy, "score", None))

    def expandable(self, node: Node) -> bool:
        return not node.terminal and node.status != FAILED and node.depth < self.max_depth

    @property
    def root(self) -> Node:
        return self.tree.root
