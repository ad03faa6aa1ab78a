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
budget in one place (:meth:`~omrl_search.budget.Budget.charge_lm`). An exception in an env or
an LM call marks that node failed and is counted as a fault; the search goes on.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any, Callable, Iterable

from .agent import ReActFormat, TurnEncoder
from .batching import SCHEDULES, LMWait, WaitingRequests, prompt_key
from .budget import Budget, BudgetExhausted
from .env import Env, make_env
from .env_driver import EnvDriver
from .ops import AskOp, EvaluateOp, ExpandOp, Op, SearchContext
from .policy import Policy
from .result import SearchResult
from .reward import RewardModel, aggregate
from .tree import EXPANDED, FAILED, TERMINAL, Node, SearchTree, unique_states
from .types import DEFAULT_MAX_TOKENS, GenRequest, Generation, SamplingParams, Task

__all__ = ["Engine", "SearchContext"]

Served = tuple[list[tuple[LMWait, int]], list[tuple[int, EvaluateOp]]]  # one driver step's work


class Engine:
    """Runs strategies over tasks with one policy (and optionally one reward model).

    ``schedule`` (``continuous`` | ``lockstep``) and ``prefix_order`` choose how LM requests of
    many trees share policy calls (see :mod:`omrl_search.batching`); results do not depend on
    them."""

    def __init__(self, policy: Policy, *, reward_model: RewardModel | None = None,
                 agent_format: ReActFormat | None = None, sampling: SamplingParams | None = None,
                 max_depth: int | None = None, seed: int = 0,
                 env_factory: Callable[[str], Env] = make_env, schedule: str = "continuous",
                 prefix_order: bool = True):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
        self.schedule, self.prefix_order = schedule, bool(prefix_order)
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
        return _Run(self, strategy, tasks, budget or Budget(), concurrency, on_result).loop()

    @property
    def answers_prompts(self) -> bool:
        """Whether the policy answers free-form prompts (``ask``); see ``Policy.answers_prompts``."""
        return bool(getattr(self.policy, "answers_prompts", True))

    # --- one search: start and result ------------------------------------------------------
    def _start(self, strategy: Any, task: Task, budget: Budget) -> SearchContext | SearchResult:
        """A new search of ``task`` (its env reset, its tree rooted), or the failed result of a
        task whose env could not be reset."""
        t0 = time.perf_counter()
        b = budget.fresh()
        try:
            env, obs, snap = EnvDriver.open(self.env_factory, task)
        except Exception as exc:
            tree = SearchTree(task, "", None)
            tree.root.status, tree.root.error = FAILED, f"{type(exc).__name__}: {exc}"
            b.stop_clock()
            return SearchResult(task=task, strategy=strategy.spec(), tree=tree, best=None,
                                success=False, spent=b.spent.as_dict(),
                                faults=[f"env reset: {tree.root.error}"], stop_reason="error",
                                seconds=time.perf_counter() - t0)
        tree = SearchTree(task, obs, snap)
        envs = EnvDriver(env, tree, b, [], self.max_depth or getattr(env, "max_steps", 20))
        prompts = self.format.prompts(env, task, tree, self.encoder)
        return SearchContext(self, task, tree, b, _mix(self.seed, task.task_id), envs, prompts)

    @staticmethod
    def _result(strategy: Any, ctx: SearchContext, stop: str) -> SearchResult:
        ctx.budget.stop_clock()
        try:
            best = strategy.select(ctx)
        except Exception as exc:
            ctx.faults.append(f"select: {type(exc).__name__}: {exc}")
            best = None
        return SearchResult(
            task=ctx.task, strategy=strategy.spec(), tree=ctx.tree,
            best=best.id if best is not None else None,
            success=bool(best is not None and best.success), spent=ctx.budget.spent.as_dict(),
            faults=ctx.faults, stop_reason=stop, seconds=ctx.budget.spent.seconds,
            verifier_in_loop=bool(getattr(strategy, "verifier_in_loop", False) or ctx.verifier_used),
        )

    # --- serving: policy calls and reward-model calls ---------------------------------------
    def _serve(self, step: Served) -> dict[int, Any]:
        """One driver step: the step's LM requests (one policy call per ``max_batch``
        sequences) and its evaluations (one reward-model call). Returns the answers of the
        ops now complete, by tree."""
        lm, evals = step
        answers: dict[int, Any] = {}
        if lm:
            if self.prefix_order:
                lm = sorted(lm, key=lambda item: prompt_key(item[0].requests[item[1]]))
            gens = self._generate([wait.requests[slot] for wait, slot in lm])
            for (wait, slot), g in zip(lm, gens):
                if wait.answer(slot, g):
                    answers[wait.i] = self._answer(wait)
        if evals:
            answers.update(self._evaluate_all(evals))
        return answers

    def _generate(self, requests: list[GenRequest]) -> list[list[Generation] | Exception]:
        """One policy call per chunk of ``max_batch`` sequences; a failed chunk is retried one
        request at a time so a bad request fails alone."""
        out: list[list[Generation] | Exception] = []
        chunk: list[GenRequest] = []
        seqs = 0
        for req in requests + [None]:  # type: ignore[list-item]
            if req is None or (chunk and seqs + req.params.n > self.policy.max_batch):
                out += self._call(chunk)
                chunk, seqs = [], 0
            if req is not None:
                chunk.append(req)
                seqs += req.params.n
        return out

    def _call(self, chunk: list[GenRequest]) -> list[list[Generation] | Exception]:
        if not chunk:
            return []
        try:
            gens = self.policy.generate(chunk)
            if len(gens) != len(chunk):
                raise RuntimeError(f"policy returned {len(gens)} results for {len(chunk)} requests")
            return list(gens)
        except Exception as exc:
            if len(chunk) == 1:
                return [exc]
            return [r for req in chunk for r in self._call([req])]

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
        out: dict[int, list[float]] = {i: [] for i, _ in ops}
        for (i, ctx, node, _), v in zip(flat, values):
            ctx.budget.charge(rm_calls=1)
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
                context_ids, req = self._request(ctx, node, op.k, op.temperature,
                                                 notes[j] if notes else "")
                work.append(context_ids)
                requests.append(req)
            return LMWait(i, op, work, requests)
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
                                _mix(ctx.seed, node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env}
        return context_ids, GenRequest(messages, params, prompt_ids, meta)

    def _ask_request(self, ctx: SearchContext, node: Node, prompt: Any, n: int,
                     temperature: float | None, max_tokens: int | None,
                     stop: tuple[str, ...]) -> GenRequest:
        messages, prompt_ids = ctx.prompts.ask(prompt)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                max_tokens or s.max_tokens, stop, n,
                                _mix(ctx.seed, "ask", node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "ask": True}
        return GenRequest(messages, params, prompt_ids, meta)

    # --- answers: charged, then children (env stepped) or texts ------------------------------
    def _answer(self, wait: LMWait) -> list:
        """An answered expand's children per node, or an answered ask's texts per prompt."""
        op = wait.op
        ctx = op.ctx
        if type(op) is AskOp:
            return [[g.text for g in gens] if (gens := self._charged(ctx, raw)) is not None else []
                    for raw in wait.gens]
        out = []
        for node, context_ids, raw in zip(op.nodes, wait.work, wait.gens):
            gens = self._charged(ctx, raw)
            if node.status != TERMINAL:
                node.status = EXPANDED
            out.append([] if gens is None else self._children(ctx, node, context_ids, gens, op.dedup))
        return out

    @staticmethod
    def _charged(ctx: SearchContext, gens: list[Generation] | Exception) -> list[Generation] | None:
        """A request's answer charged to its search's budget; None (a fault) if it failed."""
        if isinstance(gens, Exception):
            ctx.budget.charge_lm()
            ctx.faults.append(f"lm: {type(gens).__name__}: {gens}")
            return None
        ctx.budget.charge_lm(gens)
        return gens

    @staticmethod
    def _children(ctx: SearchContext, node: Node, context_ids: list[int] | None,
                  gens: list[Generation], dedup: bool) -> list[Node]:
        """``node``'s children from ``gens``: each completion parsed by the agent format and,
        if well formed, stepped in the env; with ``dedup`` a child repeating a sibling's state
        is pruned and left out."""
        seen = {ctx.tree.nodes[c].state_key for c in node.children} if dedup else None
        prompts, envs = ctx.prompts, ctx.envs
        kids = []
        for gen in gens:
            step, error = prompts.parse(gen, context_ids)
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


class _Run:
    """One :meth:`Engine.run`: the tasks not yet started, the live searches (context and
    coroutine) and what each waits on; :meth:`loop` serves them until every task has a result."""

    __slots__ = ("engine", "strategy", "budget", "on_result", "queue", "results", "limit", "live",
                 "waiting", "evals", "ready", "inflight", "streaming")

    def __init__(self, engine: Engine, strategy: Any, tasks: Iterable[Task], budget: Budget,
                 concurrency: int | None, on_result: Callable[[SearchResult], None] | None):
        self.engine, self.strategy, self.budget, self.on_result = engine, strategy, budget, on_result
        self.queue = deque(enumerate(tasks))
        self.results: list[SearchResult | None] = [None] * len(self.queue)
        self.limit = concurrency or len(self.queue) or 1
        self.live: dict[int, tuple[SearchContext, Any]] = {}
        self.waiting = WaitingRequests()  # LM requests not yet sent
        self.evals: dict[int, EvaluateOp] = {}  # evaluations not yet served, by tree
        self.ready: list[tuple[int, Any]] = []  # trees to resume at once (an op with no requests)
        self.inflight: dict[int, tuple[LMWait, int]] = {}  # streaming: submitted, not yet answered
        self.streaming = engine.schedule == "continuous" and bool(getattr(engine.policy, "streams", False))

    def loop(self) -> list[SearchResult]:
        engine = self.engine
        while self.queue or self.live:
            while self.queue and len(self.live) < self.limit:
                self.start(*self.queue.popleft())
            if self.ready:
                now, self.ready = self.ready, []
                for i, value in now:
                    self.advance(i, value)
                continue
            if not (self.waiting or self.evals or self.inflight):
                if self.live:  # every live search waits on something: a driver bug
                    raise RuntimeError("engine: live searches with nothing to serve")
                continue
            answers = self.stream() if self.streaming else engine._serve(self.next_step())
            for i in sorted(answers):
                self.advance(i, answers[i])
        return self.results  # type: ignore[return-value]

    def start(self, i: int, task: Task) -> None:
        started = self.engine._start(self.strategy, task, self.budget)
        if isinstance(started, SearchResult):
            self.done(i, started)
            return
        self.live[i] = (started, self.strategy.run(started))
        self.advance(i, None)

    def done(self, i: int, result: SearchResult) -> None:
        self.results[i] = result
        if self.on_result is not None:
            self.on_result(result)

    def finish(self, i: int, stop: str) -> None:
        ctx, _ = self.live.pop(i)
        result = self.engine._result(self.strategy, ctx, stop)
        ctx.envs.close()
        self.done(i, result)

    def advance(self, i: int, value: Any) -> None:
        """Resume tree ``i`` with ``value`` and queue the op it yields next."""
        ctx, coro = self.live[i]
        try:
            op = coro.send(value)
        except StopIteration:
            self.finish(i, "done")
        except BudgetExhausted as exc:
            self.finish(i, f"budget:{exc.args[0]}")
        except Exception as exc:  # a crashing strategy loses only its own task
            ctx.faults.append(f"strategy: {type(exc).__name__}: {exc}")
            self.finish(i, "error")
        else:
            if type(op) is EvaluateOp:
                self.evals[i] = op
                return
            try:
                wait = self.engine._wait(i, op)
            except Exception as exc:  # a prompt that cannot be built ends its own search
                coro.close()
                ctx.faults.append(f"engine: {type(exc).__name__}: {exc}")
                self.finish(i, "error")
                return
            if wait.requests:
                self.waiting.add(wait)
            else:
                self.ready.append((i, []))

    def next_step(self) -> Served:
        """What the engine serves next: LM requests taken from ``waiting`` and evaluations
        taken from ``evals``. ``lockstep``: everything. ``continuous``: the pending evaluations
        while fewer than ``max_batch`` sequences wait (their trees may top the next call up),
        else one policy call's worth: the oldest request and (``prefix_order``) its neighbours
        in prompt order, or the next oldest."""
        engine, waiting = self.engine, self.waiting
        if engine.schedule == "lockstep":
            ev = list(self.evals.items())
            self.evals.clear()
            return waiting.take(None), ev
        if self.evals and waiting.seqs < engine.policy.max_batch:
            ev = list(self.evals.items())
            self.evals.clear()
            return [], ev
        return waiting.take(engine.policy.max_batch, prompt_key if engine.prefix_order else None), []

    def stream(self) -> dict[int, Any]:
        """One driver step with a streaming backend: submit every waiting request (the backend's
        scheduler adds them to what is running), then serve the pending evaluations, or else
        collect the requests done so far. Returns the answers of the ops now complete."""
        engine, inflight = self.engine, self.inflight
        answers: dict[int, Any] = {}
        done: list[tuple[int, Any]] = []
        if self.waiting:
            items = self.waiting.take(None)
            if engine.prefix_order:
                items.sort(key=lambda item: prompt_key(item[0].requests[item[1]]))
            tickets = []
            for item in items:
                engine._tickets += 1
                inflight[engine._tickets] = item
                tickets.append((engine._tickets, item[0].requests[item[1]]))
            try:
                engine.policy.submit(tickets)
            except Exception as exc:  # the whole submission failed: each request fails alone
                done = [(t, exc) for t, _ in tickets]
        if self.evals and not done:
            ev = list(self.evals.items())
            self.evals.clear()
            return engine._evaluate_all(ev)
        if not done:
            done = engine.policy.collect()
            if not done:
                raise RuntimeError("engine: a streaming policy's collect() returned nothing")
        for ticket, gens in done:
            wait, slot = inflight.pop(ticket)
            if wait.answer(slot, gens):
                answers[wait.i] = engine._answer(wait)
        return answers


def _mix(*parts: Any) -> int:
    """A deterministic 63-bit seed from parts (``hash`` of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
