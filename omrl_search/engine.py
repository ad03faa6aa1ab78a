"""The batched search engine: the public face of a run over many search trees (docs/design.md §5).

A strategy is an ``async def run(ctx)`` that calls batched primitives on its
:class:`~omrl_search.ops.SearchContext` (``expand``, ``ask``, ``evaluate``, ``score_actions``);
each yields a typed op record (:mod:`omrl_search.ops`). The core splits the work five ways, each
part with one job and only public names between them:

* :class:`Engine` (here): what a run is made of (policy, reward model, agent format, sampling
  defaults, caps) and how its work is *served*: a search started and its result made, a driver
  step's LM requests sent in policy calls of ``max_batch`` sequences (under deadlines: the
  search's ``seconds`` budget, ``lm_timeout``), its evaluations in one reward-model call, its
  scorings in one ``Policy.score`` call.
* :class:`~omrl_search.scheduler.Run`: *when* things run: which searches are live, which waiting
  requests go into the next call (``continuous`` or ``lockstep``, see
  :mod:`omrl_search.batching`), and resuming each tree with its answer.
* :class:`~omrl_search.streaming.StreamingCalls`: the requests in flight on a policy that batches
  continuously itself (``Policy.streams``), submitted as they are made, collected as they finish.
* :class:`~omrl_search.requests.RequestBuilder`: an op's LM requests, built in its tree's own
  order so every seed comes from the tree alone; the schedule never changes a result.
* :mod:`omrl_search.children`: an answered op checked, charged, and turned into children (each
  completion parsed and stepped in the env by the search's
  :class:`~omrl_search.env_driver.EnvDriver`) or texts.

Every cost is charged to its search's :class:`~omrl_search.budget.Budget` through one named
operation per kind (``charge_lm``, ``charge_scoring``, ``charge_rm``, ``charge_env_step``).

Guards (see docs/design.md §4): an exception in an env or an LM call, a malformed answer (not a
list of well-formed :class:`~omrl_search.types.Generation` s, fewer than ``n``, NaN or +inf
logprobs), an LM call that runs past its search's ``seconds`` budget or ``lm_timeout``
(abandoned on its thread), or an error while the engine builds a tree's children
(``MemoryError`` included) is a fault of that node or that search only; the others go on. Every
search stops at ``max_nodes`` nodes and ``max_faults`` faults (stop reason ``cap:nodes=N`` /
``cap:faults=N``) whatever its budget.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Iterable

from .agent import ReActFormat, TurnEncoder
from .batching import (NOT_YET, SCHEDULES, LMWait, Round, TimedCall, call_policy, prompt_key,
                       serve_scores)
from .budget import Budget
from .children import answer_or_crash, children_of_texts
from .env import Env, make_env
from .env_driver import EnvDriver
from .ops import EvaluateOp, Op, SearchContext
from .policy import Policy
from .prompts import Constraint, ConstraintError, policy_mode
from .requests import RequestBuilder
from .result import SearchResult
from .scheduler import Run
from .reward import RewardModel, aggregate
from .tree import FAILED, Node, SearchTree
from .types import DEFAULT_MAX_TOKENS, GenRequest, SamplingParams, Task

__all__ = ["DEFAULT_MAX_FAULTS", "DEFAULT_MAX_NODES", "Engine", "SearchContext"]

#: nodes per tree and faults per search at which any search stops (``None``: no cap)
DEFAULT_MAX_NODES = 20_000
DEFAULT_MAX_FAULTS = 1_000


class Engine:
    """Runs strategies over tasks with one policy (and optionally one reward model).

    ``schedule`` (``continuous`` | ``lockstep``) and ``prefix_order`` choose how LM requests of
    many trees share policy calls (see :mod:`omrl_search.batching`); results do not depend on
    them. ``constrain`` (auto | none | format | actions) chooses the grammar of expansions (see
    :mod:`omrl_search.prompts`); a policy without structured decoding runs ``auto``
    unconstrained and refuses ``format``/``actions`` (a ConstraintError, here).
    ``lm_timeout``: seconds after which a policy call is abandoned (its requests are faults);
    ``max_nodes`` / ``max_faults``: the caps every search stops at (None: none)."""

    def __init__(self, policy: Policy, *, reward_model: RewardModel | None = None,
                 agent_format: ReActFormat | None = None, sampling: SamplingParams | None = None,
                 max_depth: int | None = None, seed: int = 0,
                 env_factory: Callable[[str], Env] = make_env, schedule: str = "continuous",
                 prefix_order: bool = True, constrain: str = "auto", lm_timeout: float | None = None,
                 max_nodes: int | None = DEFAULT_MAX_NODES, max_faults: int | None = DEFAULT_MAX_FAULTS):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
        for name, value in (("lm_timeout", lm_timeout), ("max_nodes", max_nodes), ("max_faults", max_faults)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        self.constrain = constrain
        self._mode, self._mode_note = policy_mode(constrain, policy)
        self.lm_timeout, self.max_nodes, self.max_faults = lm_timeout, max_nodes, max_faults
        # a policy that gains nothing from shared prefixes (``shares_prefixes = False``: scripted,
        # no KV cache) is not worth sorting prompts for; results never depend on the order
        self.schedule = schedule
        self.prefix_order = bool(prefix_order) and bool(getattr(policy, "shares_prefixes", True))
        self.policy = policy
        self.reward_model = reward_model
        self.format = agent_format or ReActFormat()
        self.sampling = sampling or SamplingParams(temperature=1.0, max_tokens=DEFAULT_MAX_TOKENS)
        self.max_depth = max_depth
        self.seed = seed
        self.env_factory = env_factory
        self.encoder = TurnEncoder(policy.tokenizer) if policy.tokenizer is not None else None
        self.requests = RequestBuilder(self.sampling, self.format)
        self.tickets = 0  # streaming request ids handed out (:meth:`next_ticket`)

    def run(self, strategy: Any, tasks: Iterable[Task], budget: Budget | None = None, *,
            concurrency: int | None = None, on_result: Callable[[SearchResult], None] | None = None
            ) -> list[SearchResult]:
        """Search every task with ``strategy``; each task gets a fresh copy of ``budget``.

        Up to ``concurrency`` trees are searched together (default: all); when one finishes
        the next task starts, so the policy's batches stay full.
        """
        return Run(self, strategy, tasks, budget or Budget(), concurrency, on_result).loop()

    @property
    def answers_prompts(self) -> bool:
        """Whether the policy answers free-form prompts (``ask``); see ``Policy.answers_prompts``."""
        return bool(getattr(self.policy, "answers_prompts", True))

    # --- one search: start and result ------------------------------------------------------
    def start(self, strategy: Any, task: Task, budget: Budget, spec: str
              ) -> SearchContext | SearchResult:
        """A new search of ``task`` (its env reset, its tree rooted), or the failed result of a
        task whose env could not be reset; ``spec``: the strategy's, made once per run."""
        t0 = time.perf_counter()
        b = budget.fresh()
        envs = None
        try:
            env, obs, snap = EnvDriver.open(self.env_factory, task)
            tree = SearchTree(task, obs, snap, self.format.name)
            envs = EnvDriver(env, tree, b, [], self.max_depth or getattr(env, "max_steps", 20))
            prompts = self.format.prompts(env, task, tree, self.encoder)
            if self.encoder is not None and not getattr(self.policy, "reads_messages", True):
                prompts.chat = False  # token ids only: no chat messages per step
            constraint = Constraint(self.constrain, self._mode, prompts, envs, self._mode_note)
        except Exception as exc:
            if envs is not None:
                envs.close()
            if isinstance(exc, ConstraintError):  # a setting that cannot be honoured: the run's error
                raise
            tree = SearchTree(task, "", None, self.format.name)
            where = "env reset" if envs is None else "engine"
            tree.root.status, tree.root.error = FAILED, f"{type(exc).__name__}: {exc}"
            b.stop_clock()
            return SearchResult(task=task, strategy=spec, tree=tree, best=None,
                                success=False, spent=b.spent.as_dict(),
                                faults=[f"{where}: {tree.root.error}"], stop_reason="error",
                                seconds=time.perf_counter() - t0)
        return SearchContext(self, task, tree, b, mix_seed(self.seed, task.task_id), envs, prompts,
                             constraint)

    @staticmethod
    def result(strategy: Any, ctx: SearchContext, stop: str, spec: str) -> SearchResult:
        """A finished search's result: the clock stopped, the strategy's ``select`` as its best
        answer (a crashing ``select`` is a fault: no answer), ``stop`` as its stop reason."""
        ctx.budget.stop_clock()
        try:
            best = strategy.select(ctx)
        except Exception as exc:
            ctx.faults.append(f"select: {type(exc).__name__}: {exc}")
            best = None
        return SearchResult(
            task=ctx.task, strategy=spec, tree=ctx.tree,
            best=best.id if best is not None else None,
            success=bool(best is not None and best.success), spent=ctx.budget.spent.as_dict(),
            faults=ctx.faults, stop_reason=stop, seconds=ctx.budget.spent.seconds,
            verifier_in_loop=bool(getattr(strategy, "verifier_in_loop", False) or ctx.verifier_used),
            constraint=ctx.constraint.as_dict() if ctx.constraint is not None else {},
        )

    # --- serving: policy calls and reward-model calls ---------------------------------------
    def serve(self, step: Round) -> dict[int, Any]:
        """One driver step: the step's LM requests (one policy call per ``max_batch``
        sequences), its evaluations (one reward-model call) and scorings (one ``policy.score``
        call). Returns the answers of the ops now complete, by tree. A call with deadlines
        returns at the first one that passes, answering the requests past it; the call is left
        in ``step.pending`` and the later calls' requests in ``step.unserved``."""
        answers: dict[int, Any] = {}
        lm = step.lm
        if lm:
            if self.prefix_order:
                lm = sorted(lm, key=lambda item: prompt_key(item[0].requests[item[1]]))
            requests = [wait.requests[slot] for wait, slot in lm]
            deadlines = [self.deadline(wait) for wait, _ in lm]
            for chunk in self.chunks(requests):
                items = [lm[j] for j in chunk]
                if step.pending is not None:
                    step.unserved += items
                    continue
                reqs, ds = [requests[j] for j in chunk], [deadlines[j] for j in chunk]
                if all(d is None for d in ds):
                    got = call_policy(self.policy.generate, reqs, ds)
                else:
                    timed = TimedCall(self.policy.generate, reqs, ds)
                    got = timed.advance()
                    if not timed.done:
                        step.pending = (timed, items)
                self.deliver(items, got, answers)
        if step.evals:
            answers.update(self.evaluate_all(step.evals))
        if step.scores:
            answers.update(serve_scores(self.policy, step.scores))
        return answers

    def deliver(self, items: list[tuple[LMWait, int]], got: list[Any], answers: dict[int, Any]) -> None:
        """Record each answered request (NOT_YET: not yet) and the answers of ops now complete."""
        for (wait, slot), g in zip(items, got):
            if g is not NOT_YET and wait.answer(slot, g):
                answers[wait.i] = answer_or_crash(wait)

    def chunks(self, requests: list[GenRequest]) -> list[list[int]]:
        """Request indices in calls of at most ``max_batch`` sequences (a request is never split)."""
        chunks: list[list[int]] = [[]]
        seqs = 0
        for j, req in enumerate(requests):
            if chunks[-1] and seqs + req.params.n > self.policy.max_batch:
                chunks.append([])
                seqs = 0
            chunks[-1].append(j)
            seqs += req.params.n
        return chunks if chunks[0] else []

    def generate(self, requests: list[GenRequest], deadlines: list[float | None] | None = None
                 ) -> list[Any]:
        """The policy's answers to ``requests`` outside a search: one call per chunk of
        ``max_batch`` sequences, a failed chunk retried one request at a time so a bad request
        fails alone (its exception in its place); ``deadlines``: see
        :func:`~omrl_search.batching.call_policy`."""
        deadlines = deadlines or [None] * len(requests)
        out: list[Any] = []
        for chunk in self.chunks(requests):
            out += call_policy(self.policy.generate, [requests[j] for j in chunk],
                               [deadlines[j] for j in chunk])
        return out

    def deadline(self, wait: LMWait, start: float | None = None) -> float | None:
        """When a request of ``wait`` must be answered by: its search's ``seconds`` budget, or
        ``lm_timeout`` after ``start`` (default now), whichever comes first (None: never)."""
        end = wait.op.ctx.budget.deadline()
        if self.lm_timeout is not None:
            mine = (time.perf_counter() if start is None else start) + self.lm_timeout
            end = mine if end is None else min(end, mine)
        return end

    def evaluate_all(self, ops: list[tuple[int, EvaluateOp]]) -> dict[int, list[float]]:
        """Every pending evaluation in one reward-model call; values by tree."""
        rm = self.reward_model
        flat = [(i, op.ctx, n, op.aggregation) for i, op in ops for n in op.nodes]
        trajs = [ctx.tree.trajectory(n) for _, ctx, n, _ in flat]
        try:
            got = rm.scored(trajs)
            if len(got.steps) != len(flat) or len(got.usage) != len(flat):
                raise ValueError(f"reward model answered {len(got.steps)} prefixes for {len(flat)}")
            values = [s if isinstance(s, Exception) else aggregate(s, agg or rm.aggregation)
                      for s, (*_, agg) in zip(got.steps, flat)]
            costs = [u.prefill_tokens for u in got.usage]
        except Exception as exc:
            values, costs = [exc] * len(flat), [0] * len(flat)
        out: dict[int, list[float]] = {i: [] for i, _ in ops}
        for (i, ctx, node, _), v, cost in zip(flat, values, costs):
            ctx.budget.charge_rm(cost)
            ctx.verifier_used |= rm.uses_verifier
            if isinstance(v, Exception):
                ctx.faults.append(f"rm: {type(v).__name__}: {v}")
                v = 0.0
            node.score = float(v)
            out[i].append(node.score)
        return out

    # --- requests built, answers turned into children ------------------------------------
    def requests_for(self, i: int, op: Op) -> LMWait:
        """Tree ``i``'s expand or ask as LM requests (:class:`~omrl_search.requests.RequestBuilder`)."""
        return self.requests.wait(i, op)

    @staticmethod
    def answer(wait: LMWait) -> Any:
        """An answered op's children or texts, or the search's end if building them failed
        (:func:`~omrl_search.children.answer_or_crash`)."""
        return answer_or_crash(wait)

    def apply(self, ctx: SearchContext, node: Node, completions: list[str], dedup: bool) -> list[Node]:
        """Children from given completion texts (no LM call): see ``SearchContext.apply``."""
        return children_of_texts(ctx, node, completions, dedup)

    def next_ticket(self) -> int:
        """A new streaming request id, unique per engine."""
        self.tickets += 1
        return self.tickets


def mix_seed(*parts: Any) -> int:
    """A deterministic 63-bit seed from parts (``hash`` of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
