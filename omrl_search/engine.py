"""The batched search engine.

A strategy is an ``async def run(ctx)`` that calls batched primitives on its
:class:`~omrl_search.ops.SearchContext` — ``expand`` nodes by k children, ``ask`` the LM a raw
prompt, ``evaluate`` nodes with the reward model, ``rollout`` to a terminal. The primitives yield
an operation to this driver, which advances every tree's coroutine until each is waiting and
queues the LM requests of all trees together. Each policy call then takes the oldest waiting
request and its neighbours in prompt order up to the policy's ``max_batch`` sequences, sorted
so that shared prompt prefixes sit together, and a tree resumes as soon as its own requests are answered, so the next call is
topped up with its new requests (``schedule="continuous"``; ``"lockstep"`` serves every waiting
request before resuming any tree, one round for all trees as in rStar-Math; see
:mod:`omrl_search.batching`). Pending evaluations are served together in one reward-model call.
A backend that batches continuously itself (``Policy.streams``: vLLM's engine, an
OpenAI-compatible server) gets each request as soon as its tree makes it (``submit``) and hands
back whichever are done (``collect``), so new requests join the sequences already decoding.
Plain coroutines driven by ``send`` keep this deterministic and cheap (no event loop, no
threads), and since every request's seed comes from its own tree, the schedule never changes a
result.

Every env step happens after ``restore`` of the parent's snapshot (skipped when the tree's env
is known to be in that state already). An exception in an env or an LM call marks that node
failed and is counted as a fault; the search goes on.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Iterable

from .agent import ReActFormat, TurnEncoder
from .batching import SCHEDULES, LMWait, WaitingRequests, prompt_key
from .budget import Budget, BudgetExhausted
from .env import Env, make_env
from .ops import Op, SearchContext
from .policy import Policy
from .reward import RewardModel, aggregate
from .result import SearchResult
from .tree import EXPANDED, FAILED, PRUNED, TERMINAL, Node, SearchTree
from .types import GenRequest, Generation, SamplingParams, Step, Task

__all__ = ["Engine", "SearchContext"]


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
        self.sampling = sampling or SamplingParams(temperature=1.0, max_tokens=96)
        self.max_depth = max_depth
        self.seed = seed
        self.env_factory = env_factory
        self.encoder = TurnEncoder(policy.tokenizer) if policy.tokenizer is not None else None
        self._tickets = 0  # streaming request ids, unique per engine

    # --- driver ----------------------------------------------------------------------------
    def run(self, strategy: Any, tasks: Iterable[Task], budget: Budget | None = None, *,
            concurrency: int | None = None, on_result: Callable[[SearchResult], None] | None = None
            ) -> list[SearchResult]:
        """Search every task with ``strategy``; each task gets a fresh copy of ``budget``.

        Up to ``concurrency`` trees are searched together (default: all); when one finishes
        the next task starts, so the policy's batches stay full.
        """
        budget = budget or Budget()
        queue = list(enumerate(tasks))
        results: list[SearchResult | None] = [None] * len(queue)
        limit = concurrency or len(queue) or 1
        live: dict[int, tuple[SearchContext, Any]] = {}
        waiting = WaitingRequests()
        evals: dict[int, Op] = {}
        ready: list[tuple[int, Any]] = []  # trees to resume at once (an op with no requests)
        inflight: dict[int, tuple[LMWait, int]] = {}  # streaming: submitted, not yet answered
        streaming = self.schedule == "continuous" and bool(getattr(self.policy, "streams", False))

        def finish(i: int, stop: str) -> None:
            ctx, _ = live.pop(i)
            results[i] = self._result(strategy, ctx, stop)
            ctx.env.close()
            if on_result is not None:
                on_result(results[i])

        def advance(i: int, value: Any) -> None:
            ctx, coro = live[i]
            try:
                op = coro.send(value)
            except StopIteration:
                finish(i, "done")
            except BudgetExhausted as exc:
                finish(i, f"budget:{exc.args[0]}")
            except Exception as exc:  # a crashing strategy loses only its own task
                ctx.faults.append(f"strategy: {type(exc).__name__}: {exc}")
                finish(i, "error")
            else:
                if op.kind == "evaluate":
                    evals[i] = op
                    return
                try:
                    wait = self._wait(i, op)
                except Exception as exc:  # a prompt that cannot be built ends its own search
                    coro.close()
                    ctx.faults.append(f"engine: {type(exc).__name__}: {exc}")
                    finish(i, "error")
                    return
                if wait.requests:
                    waiting.add(wait)
                else:
                    ready.append((i, []))

        while queue or live:
            while queue and len(live) < limit:
                i, task = queue.pop(0)
                started = self._start(i, task, strategy, budget)
                if isinstance(started, SearchResult):
                    results[i] = started
                    if on_result is not None:
                        on_result(started)
                    continue
                live[i] = started
                advance(i, None)
            if ready:
                now, ready = ready, []
                for i, value in now:
                    advance(i, value)
                continue
            if not (waiting or evals or inflight):
                if live:  # every live search waits on something: a driver bug
                    raise RuntimeError("engine: live searches with nothing to serve")
                continue
            answers = (self._stream(waiting, evals, inflight) if streaming
                       else self._serve(self._next(waiting, evals)))
            for i in sorted(answers):
                advance(i, answers[i])
        return results  # type: ignore[return-value]

    def _next(self, waiting: WaitingRequests, evals: dict[int, Op]
              ) -> tuple[list[tuple[LMWait, int]], list[tuple[int, Op]]]:
        """What the driver serves next: LM requests taken from ``waiting`` and evaluations
        taken from ``evals``. ``lockstep``: everything. ``continuous``: the pending evaluations
        while fewer than ``max_batch`` sequences wait (their trees may top the next call up),
        else one policy call's worth: the oldest request and (``prefix_order``) its neighbours
        in prompt order, or the next oldest."""
        if self.schedule == "lockstep":
            ev = list(evals.items())
            evals.clear()
            return waiting.take(None), ev
        if evals and waiting.seqs < self.policy.max_batch:
            ev = list(evals.items())
            evals.clear()
            return [], ev
        return waiting.take(self.policy.max_batch, prompt_key if self.prefix_order else None), []

    def _serve(self, step: tuple[list[tuple[LMWait, int]], list[tuple[int, Op]]]) -> dict[int, Any]:
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

    def _stream(self, waiting: WaitingRequests, evals: dict[int, Op],
                inflight: dict[int, tuple[LMWait, int]]) -> dict[int, Any]:
        """One driver step with a streaming backend: submit every waiting request (the backend's
        scheduler adds them to what is running), then serve the pending evaluations, or else
        collect the requests done so far. Returns the answers of the ops now complete."""
        answers: dict[int, Any] = {}
        done: list[tuple[int, Any]] = []
        if waiting:
            items = waiting.take(None)
            if self.prefix_order:
                items.sort(key=lambda item: prompt_key(item[0].requests[item[1]]))
            tickets = []
            for item in items:
                self._tickets += 1
                inflight[self._tickets] = item
                tickets.append((self._tickets, item[0].requests[item[1]]))
            try:
                self.policy.submit(tickets)
            except Exception as exc:  # the whole submission failed: each request fails alone
                done = [(t, exc) for t, _ in tickets]
        if evals and not done:
            ev = list(evals.items())
            evals.clear()
            return self._evaluate_all(ev)
        if not done:
            done = self.policy.collect()
            if not done:
                raise RuntimeError("engine: a streaming policy's collect() returned nothing")
        for ticket, gens in done:
            wait, slot = inflight.pop(ticket)
            if wait.answer(slot, gens):
                answers[wait.i] = self._answer(wait)
        return answers

    @property
    def answers_prompts(self) -> bool:
        """Whether the policy answers free-form prompts (``ask``); see ``Policy.answers_prompts``."""
        return bool(getattr(self.policy, "answers_prompts", True))

    def _start(self, i: int, task: Task, strategy: Any, budget: Budget):
        t0 = time.perf_counter()
        b = budget.fresh()
        try:
            env = self.env_factory(task.env)
            obs = env.reset(task)
            snap = env.snapshot()
        except Exception as exc:
            tree = SearchTree(task, "", None)
            tree.root.status, tree.root.error = FAILED, f"{type(exc).__name__}: {exc}"
            b.stop_clock()
            return SearchResult(task=task, strategy=strategy.spec(), tree=tree, best=None,
                                success=False, spent=b.spent.as_dict(),
                                faults=[f"env reset: {tree.root.error}"], stop_reason="error",
                                seconds=time.perf_counter() - t0)
        tree = SearchTree(task, obs, snap)
        seed = _mix(self.seed, task.task_id)
        depth = self.max_depth or getattr(env, "max_steps", 20)
        ctx = SearchContext(self, task, env, tree, b, seed, depth)
        return ctx, strategy.run(ctx)

    def _result(self, strategy: Any, ctx: SearchContext, stop: str) -> SearchResult:
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

    # --- expansion -------------------------------------------------------------------------
    def _wait(self, i: int, op: Op) -> LMWait:
        """The requests of tree ``i``'s expand or ask (built now, in the tree's own order, so
        each request's seed depends on its tree alone)."""
        ctx = op.ctx
        work = []  # (node, dedup, context_ids) per request; node None for asks
        requests = []
        if op.kind == "expand":
            nodes, k, temperature, dedup, notes = op.args
            for j, node in enumerate(nodes):
                context_ids, req = self._request(ctx, node, k, temperature,
                                                 notes[j] if notes else "")
                work.append((node, dedup, context_ids))
                requests.append(req)
        else:
            nodes, prompts, n, temperature, max_tokens, stop = op.args
            for node, prompt in zip(nodes, prompts):
                work.append((None, False, None))
                requests.append(self._ask_request(ctx, node, prompt, n, temperature,
                                                  max_tokens, stop))
        return LMWait(i, op, work, requests)

    def _answer(self, wait: LMWait) -> list:
        """An answered expand's children (env stepped) or an ask's texts, per request."""
        ctx = wait.op.ctx
        return [self._texts(ctx, g) if node is None else
                self._children(ctx, node, context_ids, g, dedup)
                for (node, dedup, context_ids), g in zip(wait.work, wait.gens)]

    def _messages(self, ctx: SearchContext, node: Node) -> list[dict[str, str]]:
        """The chat up to ``node``'s observation (without notes), cached per node."""
        cached = ctx._messages.get(node.id)
        if cached is None:
            if node.parent is None:
                cached = self.format.first_messages(ctx.env, ctx.task, node.observation)
            else:
                cached = self._messages(ctx, ctx.tree.nodes[node.parent]) + [
                    {"role": "assistant", "content": node.step.completion},
                    self.format.observation_message(node.observation)]
            ctx._messages[node.id] = cached
        return cached

    def _request(self, ctx: SearchContext, node: Node, k: int, temperature: float | None,
                 note: str) -> tuple[list[int] | None, GenRequest]:
        messages = self._messages(ctx, node)
        if note:
            last = (self.format.first_messages(ctx.env, ctx.task, node.observation, note)[-1]
                    if node.parent is None else self.format.observation_message(node.observation, note))
            messages = messages[:-1] + [last]
        context_ids = prompt_ids = None
        if self.encoder is not None:
            context_ids = self._context_ids(node, messages)
            prompt_ids = context_ids if node.parent is None else self._prompt_ids(ctx, node, context_ids)
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                s.max_tokens, s.stop or self.format.stop, k,
                                _mix(ctx.seed, node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env}
        return context_ids, GenRequest(messages, params, prompt_ids, meta)

    def _context_ids(self, node: Node, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids added before a step from ``node``: the whole first prompt at the root,
        else the turn that shows ``node``'s observation (the last message)."""
        if node.parent is None:
            return self.encoder.first_prompt(messages)
        return self.encoder.observation_turn(messages[-1]["content"], node.step.completion_ids or [])

    @staticmethod
    def _prompt_ids(ctx: SearchContext, node: Node, tail: list[int]) -> list[int]:
        """The exact ids the policy sees at ``node``: each step's context and completion ids
        along the path, then ``tail``, copied once into a new list (never re-rendered)."""
        parts, nodes = [tail], ctx.tree.nodes
        while node.parent is not None:
            step = node.step
            parts += (step.completion_ids or (), step.context_ids or ())
            node = nodes[node.parent]
        out: list[int] = []
        for part in reversed(parts):
            out += part
        return out

    def _ask_request(self, ctx: SearchContext, node: Node, prompt: Any, n: int,
                     temperature: float | None, max_tokens: int | None,
                     stop: tuple[str, ...]) -> GenRequest:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        prompt_ids = self.encoder.first_prompt(messages) if self.encoder is not None else None
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                max_tokens or s.max_tokens, stop, n,
                                _mix(ctx.seed, "ask", node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "ask": True}
        return GenRequest(messages, params, prompt_ids, meta)

    @staticmethod
    def _texts(ctx: SearchContext, gens: list[Generation] | Exception) -> list[str]:
        ctx.budget.charge(lm_calls=1)
        if isinstance(gens, Exception):
            ctx.faults.append(f"lm: {type(gens).__name__}: {gens}")
            return []
        if gens:
            ctx.budget.charge(prompt_tokens=gens[0].prompt_tokens,
                              completion_tokens=sum(g.completion_tokens for g in gens))
        return [g.text for g in gens]

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

    def _children(self, ctx: SearchContext, node: Node, context_ids: list[int] | None,
                  gens: list[Generation] | Exception, dedup: bool) -> list[Node]:
        budget = ctx.budget
        budget.charge(lm_calls=1)
        node.status = EXPANDED if node.status != TERMINAL else node.status
        if isinstance(gens, Exception):
            ctx.faults.append(f"lm: {type(gens).__name__}: {gens}")
            return []
        if gens:
            budget.charge(prompt_tokens=gens[0].prompt_tokens,
                          completion_tokens=sum(g.completion_tokens for g in gens))
        return self._add(ctx, node, context_ids, gens, dedup)

    def _add(self, ctx: SearchContext, node: Node, context_ids: list[int] | None,
             gens: list[Generation], dedup: bool) -> list[Node]:
        seen = {ctx.tree.nodes[c].state_key for c in node.children} if dedup else None
        kids = []
        for gen in gens:
            child = self._step(ctx, node, context_ids, gen)
            if seen is not None and child.status != FAILED:
                if child.state_key in seen:
                    child.status, child.error = PRUNED, "duplicate state"
                    continue
                seen.add(child.state_key)
            kids.append(child)
        return kids

    def apply(self, ctx: SearchContext, node: Node, completions: list[str], dedup: bool) -> list[Node]:
        """Children from given completion texts (no LM call): see ``SearchContext.apply``."""
        context_ids = None
        if self.encoder is not None:
            context_ids = self._context_ids(node, self._messages(ctx, node))
        encode = self.encoder.tok.encode if self.encoder is not None else (lambda _: [])
        gens = [Generation(text, encode(text), None, 0, 0) for text in completions]
        node.status = EXPANDED if node.status != TERMINAL else node.status
        return self._add(ctx, node, context_ids, gens, dedup)

    def heuristic(self, ctx: SearchContext, nodes: list[Node]) -> list[float]:
        """``env.heuristic()`` at each node's state (restored first); a crash scores 0."""
        out = []
        for node in nodes:
            try:
                if ctx.env_at != node.id:
                    ctx.env_at = None
                    ctx.env.restore(node.snapshot)
                    ctx.env_at = node.id
                out.append(float(ctx.env.heuristic()))
            except Exception as exc:
                ctx.env_at = None
                ctx.faults.append(f"env heuristic: {type(exc).__name__}: {exc}")
                out.append(0.0)
        return out

    def _step(self, ctx: SearchContext, node: Node, context_ids: list[int] | None,
              gen: Generation) -> Node:
        env, tree = ctx.env, ctx.tree
        parsed = self.format.parse(gen.text, getattr(env, "action_help", ""))
        step = Step(gen.text, parsed.thought, parsed.action, "", context_ids=context_ids,
                    completion_ids=gen.token_ids, logprobs=gen.logprobs)
        if parsed.error:
            step.observation, step.valid = parsed.error, False
            child = tree.add_child(node, step, node.snapshot, node.state_key)
            return self._mark_depth(ctx, child)
        try:
            if ctx.env_at != node.id:
                ctx.env_at = None
                env.restore(node.snapshot)
            res = env.step(parsed.action)
            ctx.budget.charge(env_steps=1)
            snap = env.snapshot()
        except Exception as exc:
            ctx.env_at = None
            err = f"{type(exc).__name__}: {exc}"
            ctx.faults.append(f"env: {err}")
            step.observation = f"Environment error: {err}"
            child = tree.add_child(node, step, None, "")
            child.status, child.error = FAILED, err
            return child
        step.observation, step.reward, step.done, step.info = (
            res.observation, res.reward, res.done, res.info)
        step.valid, step.success = res.valid, res.success
        child = tree.add_child(node, step, snap, snap.state_key)
        ctx.env_at = child.id
        if res.done:
            child.terminal, child.status = True, TERMINAL
            child.success = res.success
            return child
        return self._mark_depth(ctx, child)

    @staticmethod
    def _mark_depth(ctx: SearchContext, child: Node) -> Node:
        if child.depth >= ctx.max_depth:
            child.terminal, child.status, child.error = True, TERMINAL, "max depth"
        return child

    # --- evaluation ------------------------------------------------------------------------
    def _evaluate_all(self, ops: list[tuple[int, Op]]) -> dict[int, list[float]]:
        rm = self.reward_model
        flat = [(i, op.ctx, n, op.args[1]) for i, op in ops for n in op.args[0]]
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


def _mix(*parts: Any) -> int:
    """A deterministic 63-bit seed from parts (``hash`` of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
