"""The batched search engine: it schedules the ops of many search trees under their budgets.

A strategy is an ``async def run(ctx)`` that calls batched primitives on its
:class:`~omrl_search.ops.SearchContext` — ``expand`` nodes by k children, ``ask`` the LM a raw
prompt, ``evaluate`` nodes with the reward model, ``rollout`` to a terminal. The primitives yield
a typed op record (:mod:`omrl_search.ops`) to this driver, which advances every tree's coroutine
until each is waiting and queues the LM requests of all trees together. Each policy call then
takes the oldest waiting request and its neighbours in prompt order up to the policy's
``max_batch`` sequences, sorted so that shared prompt prefixes sit together, and a tree resumes
as soon as its own requests are answered, so the next call is topped up with its new requests
(``schedule="continuous"``; ``"lockstep"`` serves every waiting request before resuming any
tree, one round for all trees as in rStar-Math; see :mod:`omrl_search.batching`). Pending
evaluations are served together in one reward-model call. A backend that batches continuously
itself (``Policy.streams``: vLLM's engine, an OpenAI-compatible server) gets each request as soon
as its tree makes it (``submit``) and hands back whichever are done (``collect``), so new
requests join the sequences already decoding. Plain coroutines driven by ``send`` keep this
deterministic and cheap (no event loop, no threads), and since every request's seed comes from
its own tree, the schedule never changes a result.

What the engine does not do itself: prompts come from the agent format
(:class:`~omrl_search.prompts.Prompts`), env steps and restores from the search's
:class:`~omrl_search.env_driver.EnvDriver`, and every LM request is charged to its search's
budget in one place (:meth:`~omrl_search.budget.Budget.charge_lm`). Structured decoding
(``constrain``): each expansion's request carries the grammar the search's
:class:`~omrl_search.prompts.Constraint` gives its node (see docs/design.md §4).

Guards (see docs/design.md §4): an exception in an env or an LM call, a malformed answer (not a
list of well-formed :class:`~omrl_search.types.Generation` s, fewer than ``n``), an LM call that
runs past its search's ``seconds`` budget or ``lm_timeout`` (abandoned on its thread), or an
error while the engine builds a tree's children (``MemoryError`` included) is a fault of that
node or that search only; the others go on. Every search stops at ``max_nodes`` nodes and
``max_faults`` faults (stop reason ``cap:nodes=N`` / ``cap:faults=N``) whatever its budget.

Cost per node (``benchmarks/engine_overhead*.py``, ``engine_instructions.py``, docs/scaling.md):
almost every object a search makes (nodes, steps, snapshots, id lists) lives as long as its
tree, so the cyclic garbage collector's passes over them find nothing; during
:meth:`Engine.run` its thresholds are raised
(:func:`fewer_collections`: young collections every 50,000 allocations, full ones rarely),
restored after. Prompts are sorted by prefix only for policies that gain from it (not those
that set ``shares_prefixes = False``), step requests carry no chat messages for policies that
read token ids only (``reads_messages = False``), and request seeds hash the search's seed once
(:class:`~omrl_search.ops.Seeds`).
"""
from __future__ import annotations

import gc
import hashlib
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Sequence

from .agent import ReActFormat, TurnEncoder
from .batching import (NOT_YET, SCHEDULES, Crashed, LMWait, Round, TimedCall, call_policy,
                       prompt_key, serve_scores, well_formed)
from .budget import Budget
from .constrain import Grammar
from .env import Env, make_env
from .env_driver import EnvDriver
from .ops import AskOp, EvaluateOp, ExpandOp, Op, SearchContext
from .policy import Policy
from .prompts import Constraint, ConstraintError, policy_mode
from .result import SearchResult
from .scheduler import Run
from .reward import RewardModel, aggregate
from .tree import EXPANDED, FAILED, TERMINAL, Node, SearchTree, dedup_key, unique_states
from .types import DEFAULT_MAX_TOKENS, GenRequest, Generation, SamplingParams, Task

__all__ = ["DEFAULT_MAX_FAULTS", "DEFAULT_MAX_NODES", "Engine", "SearchContext"]

#: nodes per tree and faults per search at which any search stops (``None``: no cap)
DEFAULT_MAX_NODES = 20_000
DEFAULT_MAX_FAULTS = 1_000


_SKIPPED = object()  # the answer of a request the engine did not send (a node it would not expand)


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
        self._tickets = 0  # streaming request ids, unique per engine

    def run(self, strategy: Any, tasks: Iterable[Task], budget: Budget | None = None, *,
            concurrency: int | None = None, on_result: Callable[[SearchResult], None] | None = None
            ) -> list[SearchResult]:
        """Search every task with ``strategy``; each task gets a fresh copy of ``budget``.

        Up to ``concurrency`` trees are searched together (default: all); when one finishes
        the next task starts, so the policy's batches stay full.
        """
        with fewer_collections():
            return Run(self, strategy, tasks, budget or Budget(), concurrency, on_result).loop()

    @property
    def answers_prompts(self) -> bool:
        """Whether the policy answers free-form prompts (``ask``); see ``Policy.answers_prompts``."""
        return bool(getattr(self.policy, "answers_prompts", True))

    # --- one search: start and result ------------------------------------------------------
    def _start(self, strategy: Any, task: Task, budget: Budget, spec: str
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
        return SearchContext(self, task, tree, b, _mix(self.seed, task.task_id), envs, prompts,
                             constraint)

    @staticmethod
    def _result(strategy: Any, ctx: SearchContext, stop: str, spec: str) -> SearchResult:
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
    def _serve(self, step: Round) -> dict[int, Any]:
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
            deadlines = [self._deadline(wait) for wait, _ in lm]
            for chunk in self._chunks(requests):
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
                self._deliver(items, got, answers)
        if step.evals:
            answers.update(self._evaluate_all(step.evals))
        if step.scores:
            answers.update(serve_scores(self.policy, step.scores))
        return answers

    def _deliver(self, items: list[tuple[LMWait, int]], got: list[Any], answers: dict[int, Any]) -> None:
        """Record each answered request (NOT_YET: not yet) and the answers of ops now complete."""
        for (wait, slot), g in zip(items, got):
            if g is not NOT_YET and wait.answer(slot, g):
                answers[wait.i] = self._answer_safely(wait)

    def _chunks(self, requests: list[GenRequest]) -> list[list[int]]:
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

    def _deadline(self, wait: LMWait, start: float | None = None) -> float | None:
        """When a request of ``wait`` must be answered by: its search's ``seconds`` budget, or
        ``lm_timeout`` after ``start`` (default now), whichever comes first (None: never)."""
        end = wait.op.ctx.budget.deadline()
        if self.lm_timeout is not None:
            mine = (time.perf_counter() if start is None else start) + self.lm_timeout
            end = mine if end is None else min(end, mine)
        return end

    def _generate(self, requests: list[GenRequest], deadlines: Sequence[float | None] | None = None
                  ) -> list[list[Generation] | Exception]:
        """One policy call per chunk of ``max_batch`` sequences; a failed chunk is retried one
        request at a time so a bad request fails alone. ``deadlines`` (one per request):
        see :func:`~omrl_search.batching.call_policy`."""
        if deadlines is None:
            deadlines = [None] * len(requests)
        out: list[list[Generation] | Exception] = []
        for chunk in self._chunks(requests):
            out += call_policy(self.policy.generate, [requests[j] for j in chunk],
                               [deadlines[j] for j in chunk])
        return out

    def _evaluate_all(self, ops: list[tuple[int, EvaluateOp]]) -> dict[int, list[float]]:
        """Every pending evaluation in one reward-model call; values by tree."""
        rm = self.reward_model
        flat = [(i, op.ctx, n, op.aggregation) for i, op in ops for n in op.nodes]
        trajs = [ctx.tree.trajectory(n) for _, ctx, n, _ in flat]
        try:
            if all(agg is None for *_, agg in flat):
                values = rm.value(trajs)
            else:
                values = [s if isinstance(s, Exception) else aggregate(s, agg or rm.aggregation)
                          for s, (*_, agg) in zip(rm.score(trajs), flat)]
        except Exception as exc:
            values = [exc] * len(flat)
        costs = getattr(rm, "last_tokens", None)  # per prefix, from reward models that count them
        if not isinstance(costs, list) or len(costs) != len(flat):
            costs = [0] * len(flat)
        out: dict[int, list[float]] = {i: [] for i, _ in ops}
        for (i, ctx, node, _), v, cost in zip(flat, values, costs):
            ctx.budget.charge(rm_calls=1, rm_tokens=int(cost))
            ctx.verifier_used |= rm.uses_verifier
            if isinstance(v, Exception):
                ctx.faults.append(f"rm: {type(v).__name__}: {v}")
                v = 0.0
            node.score = float(v)
            out[i].append(node.score)
        return out

    # --- requests: an expand's or an ask's, built in its tree's own order --------------------
    def _wait(self, i: int, op: Op) -> LMWait:
        """The requests of tree ``i``'s expand or ask (built now, in the tree's own order, so
        each request's seed depends on its tree alone); ``work`` keeps each expand request's
        context ids for its children."""
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
                context_ids, req = self._request(ctx, node, op.k, op.temperature,
                                                 notes[j] if notes else "")
                req.grammar = grammar
                work.append((context_ids, grammar))
                requests.append(req)
            return LMWait(i, op, work, requests, _SKIPPED)
        if type(op) is not AskOp:
            raise TypeError(f"a strategy awaited {op!r}, not an engine op")
        requests = [self._ask_request(ctx, node, prompt, op.n, op.temperature, op.max_tokens, op.stop)
                    for node, prompt in zip(op.nodes, op.prompts)]
        return LMWait(i, op, [None] * len(requests), requests)

    def _request(self, ctx: SearchContext, node: Node, k: int, temperature: float | None,
                 note: str) -> tuple[list[int] | None, GenRequest]:
        messages, context_ids, prompt_ids = ctx.prompts.step(node, note)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                s.max_tokens, s.stop or ctx.prompts.stop, k,
                                ctx.seeds.step(node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "agent": self.format}
        return context_ids, GenRequest(messages, params, prompt_ids, meta)

    def _ask_request(self, ctx: SearchContext, node: Node, prompt: Any, n: int,
                     temperature: float | None, max_tokens: int | None,
                     stop: tuple[str, ...]) -> GenRequest:
        messages, prompt_ids = ctx.prompts.ask(prompt)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                max_tokens or s.max_tokens, stop, n,
                                ctx.seeds.ask(node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "ask": True}
        return GenRequest(messages, params, prompt_ids, meta)

    # --- answers: charged, then children (env stepped) or texts ------------------------------
    def _answer_safely(self, wait: LMWait) -> Any:
        """:meth:`_answer`, or the search's end if building it failed (MemoryError included)."""
        try:
            return self._answer(wait)
        except Exception as exc:
            return Crashed(exc)

    def _answer(self, wait: LMWait) -> list:
        """An answered expand's children per node, or an answered ask's texts per prompt."""
        op = wait.op
        ctx = op.ctx
        if type(op) is AskOp:
            return [[g.text for g in gens] if (gens := self._charged(ctx, raw, op.n)) is not None else []
                    for raw in wait.gens]
        out = []
        for node, work, raw in zip(op.nodes, wait.work, wait.gens):
            if raw is _SKIPPED:
                out.append([])
                continue
            context_ids, grammar = work
            gens = self._charged(ctx, raw, op.k)
            if node.status != TERMINAL:
                node.status = EXPANDED
            if gens is not None and ctx.constraint is not None:
                ctx.constraint.count(gens, grammar)
            out.append([] if gens is None else
                       self._children(ctx, node, context_ids, gens, op.dedup, grammar))
        return out

    @staticmethod
    def _charged(ctx: SearchContext, gens: Any, n: int) -> list[Generation] | None:
        """A request's answer, its well-formed generations charged to its search's budget; a
        failed request, each malformed generation and a short answer are faults. None when
        nothing usable came back."""
        if isinstance(gens, Exception):
            ctx.budget.charge_lm()
            ctx.faults.append(f"lm: {type(gens).__name__}: {gens}")
            return None
        good, problems = well_formed(gens, n)
        ctx.budget.charge_lm(good)
        if problems:
            ctx.faults += (f"lm: {p}" for p in problems)
        return good or None

    @staticmethod
    def _children(ctx: SearchContext, node: Node, context_ids: list[int] | None,
                  gens: list[Generation], dedup: bool, grammar: Grammar | None = None) -> list[Node]:
        """``node``'s children from ``gens``: each completion parsed by the agent format and,
        if well formed, stepped in the env; with ``dedup`` a child repeating a sibling's state
        (by :func:`~omrl_search.tree.dedup_key`) is pruned and left out. A completion generated
        under ``grammar`` (its ``constraint`` not "none") records it in ``Step.grammar`` as a
        plain dict, for trainers to rebuild the masks."""
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

    def apply(self, ctx: SearchContext, node: Node, completions: list[str], dedup: bool) -> list[Node]:
        """Children from given completion texts (no LM call): see ``SearchContext.apply``."""
        prompts = ctx.prompts
        context_ids = prompts.context_ids(node)
        gens = [Generation(text, prompts.encode(text), None, 0, 0) for text in completions]
        if node.status != TERMINAL:
            node.status = EXPANDED
        return self._children(ctx, node, context_ids, gens, dedup)


def _mix(*parts: Any) -> int:
    """A deterministic 63-bit seed from parts (``hash`` of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_collections(young: int = 50_000, full_every: int = 1_000):
    """Raise the garbage collector's thresholds for the block (young collections every
    ``young`` allocations, a full one every ``full_every`` middle ones at most); restored
    when the outermost block ends. A search's objects live as long as its tree, so the
    collector's passes over them find nothing; with the default thresholds they cost 10-20%
    of the engine's time. Garbage cycles are still collected, just in larger batches. A
    collector that is off, or set higher already, is left as it is."""
    global _gc_depth, _gc_saved
    with _gc_lock:
        if _gc_depth == 0:
            _gc_saved = gc.get_threshold()
            t0, t1, t2 = _gc_saved
            if gc.isenabled() and t0 > 0:
                gc.set_threshold(max(t0, young), t1, max(t2, full_every))
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                _gc_saved = None
