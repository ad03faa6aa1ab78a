"""The batched search engine.

A strategy is an ``async def run(ctx)`` that calls batched primitives on its
:class:`SearchContext` — ``expand`` nodes by k children, ``evaluate`` nodes with the reward
model, ``rollout`` to a terminal. The primitives do not call anything themselves: they yield an
operation to the engine's driver, which advances every tree's coroutine until each is waiting,
then serves all pending expansions of all trees with one policy call and all pending evaluations
with one reward-model call (lockstep across tasks, as in rStar-Math), and resumes them. Plain
coroutines driven by ``send`` keep this deterministic and cheap (no event loop, no threads).

Every env step happens after ``restore`` of the parent's snapshot (skipped when the tree's env
is known to be in that state already). An exception in an env or an LM call marks that node
failed and is counted as a fault; the search goes on.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, Iterable, Sequence

from .agent import ReActFormat, TurnEncoder
from .budget import Budget, BudgetExhausted
from .env import Env, make_env
from .policy import Policy
from .reward import RewardModel
from .result import SearchResult
from .tree import EXPANDED, FAILED, PRUNED, TERMINAL, Node, SearchTree
from .types import GenRequest, Generation, SamplingParams, Step, Task


class _Op:
    """An operation a strategy waits on; the driver fills in the result."""

    __slots__ = ("kind", "ctx", "args")

    def __init__(self, kind: str, ctx: "SearchContext", args: tuple):
        self.kind, self.ctx, self.args = kind, ctx, args

    def __await__(self):
        return (yield self)


class SearchContext:
    """What a strategy sees of one search: its tree, budget, RNG and the batched primitives."""

    def __init__(self, engine: "Engine", task: Task, env: Env, tree: SearchTree, budget: Budget,
                 seed: int, max_depth: int):
        self.engine, self.task, self.env, self.tree, self.budget = engine, task, env, tree, budget
        self.rng = random.Random(seed)
        self.seed = seed
        self.max_depth = max_depth
        self.faults: list[str] = []
        self.env_at: int | None = 0  # node whose state the live env holds
        self.calls = 0
        self.has_reward_model = engine.reward_model is not None

    # --- primitives ------------------------------------------------------------------------
    async def expand(self, nodes: Sequence[Node], k: int = 1, *, temperature: float | None = None,
                     dedup: bool = False, notes: Sequence[str] | None = None) -> list[list[Node]]:
        """Sample ``k`` completions at each node, step the env for each, return the children.

        ``notes`` adds text to each node's prompt (e.g. DFSDT's previously tried siblings).
        With ``dedup`` a child whose state key equals an existing sibling's is kept in the tree
        as pruned and not returned. Raises :class:`BudgetExhausted` before asking, never after.
        """
        self.budget.check()
        if not nodes:
            return []
        return await _Op("expand", self, (list(nodes), k, temperature, dedup, notes))

    async def evaluate(self, nodes: Sequence[Node]) -> list[float]:
        """Reward-model values of the paths ending at ``nodes`` (stored in ``node.score``)."""
        if self.engine.reward_model is None:
            raise RuntimeError("evaluate() needs a reward model")
        self.budget.check()
        if not nodes:
            return []
        return await _Op("evaluate", self, (list(nodes),))

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

    # --- helpers ---------------------------------------------------------------------------
    def expandable(self, node: Node) -> bool:
        return not node.terminal and node.status != FAILED and node.depth < self.max_depth

    @property
    def root(self) -> Node:
        return self.tree.root


class Engine:
    """Runs strategies over tasks with one policy (and optionally one reward model)."""

    def __init__(self, policy: Policy, *, reward_model: RewardModel | None = None,
                 agent_format: ReActFormat | None = None, sampling: SamplingParams | None = None,
                 max_depth: int | None = None, seed: int = 0,
                 env_factory: Callable[[str], Env] = make_env):
        self.policy = policy
        self.reward_model = reward_model
        self.format = agent_format or ReActFormat()
        self.sampling = sampling or SamplingParams(temperature=1.0, max_tokens=96)
        self.max_depth = max_depth
        self.seed = seed
        self.env_factory = env_factory
        self.encoder = TurnEncoder(policy.tokenizer) if policy.tokenizer is not None else None

    # --- driver ----------------------------------------------------------------------------
    def run(self, strategy: Any, tasks: Iterable[Task], budget: Budget | None = None, *,
            concurrency: int | None = None, on_result: Callable[[SearchResult], None] | None = None
            ) -> list[SearchResult]:
        """Search every task with ``strategy``; each task gets a fresh copy of ``budget``.

        Up to ``concurrency`` trees run in lockstep (default: all); when one finishes the next
        task starts, so the policy's batches stay full.
        """
        budget = budget or Budget()
        queue = list(enumerate(tasks))
        results: list[SearchResult | None] = [None] * len(queue)
        limit = concurrency or len(queue) or 1
        live: dict[int, tuple[SearchContext, Any]] = {}
        pending: dict[int, _Op] = {}

        def finish(i: int, stop: str) -> None:
            ctx, _ = live.pop(i)
            results[i] = self._result(strategy, ctx, stop)
            ctx.env.close()
            if on_result is not None:
                on_result(results[i])

        def advance(i: int, value: Any) -> None:
            ctx, coro = live[i]
            try:
                pending[i] = coro.send(value)
            except StopIteration:
                finish(i, "done")
            except BudgetExhausted as exc:
                finish(i, f"budget:{exc.args[0]}")
            except Exception as exc:  # a crashing strategy loses only its own task
                ctx.faults.append(f"strategy: {type(exc).__name__}: {exc}")
                finish(i, "error")

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
            if not pending:
                continue
            ops, pending = pending, {}
            answers = {}
            expands = [(i, op) for i, op in ops.items() if op.kind == "expand"]
            evals = [(i, op) for i, op in ops.items() if op.kind == "evaluate"]
            if expands:
                answers.update(self._expand_all(expands))
            if evals:
                answers.update(self._evaluate_all(evals))
            for i in sorted(answers):
                advance(i, answers[i])
        return results  # type: ignore[return-value]

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
            verifier_in_loop=bool(getattr(strategy, "verifier_in_loop", False)),
        )

    # --- expansion -------------------------------------------------------------------------
    def _expand_all(self, ops: list[tuple[int, _Op]]) -> dict[int, list[list[Node]]]:
        work = []  # (op index, ctx, node, dedup, context_ids, request)
        for i, op in ops:
            nodes, k, temperature, dedup, notes = op.args
            for j, node in enumerate(nodes):
                note = notes[j] if notes else ""
                work.append((i, op.ctx, node, dedup,
                             *self._request(op.ctx, node, k, temperature, note)))
        gens = self._generate([w[5] for w in work])
        out: dict[int, list[list[Node]]] = {i: [] for i, _ in ops}
        for (i, ctx, node, dedup, context_ids, _), g in zip(work, gens):
            out[i].append(self._children(ctx, node, context_ids, g, dedup))
        return out

    def _request(self, ctx: SearchContext, node: Node, k: int, temperature: float | None,
                 note: str) -> tuple[list[int] | None, GenRequest]:
        path = ctx.tree.path(node)
        messages = self.format.first_messages(ctx.env, ctx.task, path[0].observation,
                                              note if node.parent is None else "")
        for n in path[1:]:
            messages.append({"role": "assistant", "content": n.step.completion})
            messages.append(self.format.observation_message(
                n.observation, note if n is node else ""))
        context_ids = prompt_ids = None
        if self.encoder is not None:
            if node.parent is None:
                context_ids = self.encoder.first_prompt(messages)
                prompt_ids = context_ids
            else:
                context_ids = self.encoder.observation_turn(
                    messages[-1]["content"], node.step.completion_ids or [])
                prompt_ids = []
                for n in path[1:]:
                    prompt_ids += n.step.context_ids or []
                    prompt_ids += n.step.completion_ids or []
                prompt_ids += context_ids
        ctx.calls += 1
        s = self.sampling
        params = SamplingParams(s.temperature if temperature is None else temperature, s.top_p,
                                s.max_tokens, s.stop or self.format.stop, k,
                                _mix(ctx.seed, node.id, ctx.calls))
        meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env}
        return context_ids, GenRequest(messages, params, prompt_ids, meta)

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
        seen = {ctx.tree.nodes[c].state_key for c in node.children} if dedup else set()
        kids = []
        for gen in gens:
            child = self._step(ctx, node, context_ids, gen)
            if dedup and child.status != FAILED:
                if child.state_key in seen:
                    child.status, child.error = PRUNED, "duplicate state"
                    continue
                seen.add(child.state_key)
            kids.append(child)
        return kids

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
        step.valid = bool(res.info.get("valid", True))
        child = tree.add_child(node, step, snap, snap.state_key)
        ctx.env_at = child.id
        if res.done:
            child.terminal, child.status = True, TERMINAL
            child.success = bool(res.info.get("success", False))
            return child
        return self._mark_depth(ctx, child)

    @staticmethod
    def _mark_depth(ctx: SearchContext, child: Node) -> Node:
        if child.depth >= ctx.max_depth:
            child.terminal, child.status, child.error = True, TERMINAL, "max depth"
        return child

    # --- evaluation ------------------------------------------------------------------------
    def _evaluate_all(self, ops: list[tuple[int, _Op]]) -> dict[int, list[float]]:
        rm = self.reward_model
        flat = [(i, op.ctx, n) for i, op in ops for n in op.args[0]]
        trajs = [ctx.tree.trajectory(n) for _, ctx, n in flat]
        try:
            values = rm.value(trajs)
        except Exception as exc:
            values = [exc] * len(flat)
        out: dict[int, list[float]] = {i: [] for i, _ in ops}
        for (i, ctx, node), v in zip(flat, values):
            ctx.budget.charge(rm_calls=1)
            if isinstance(v, Exception):
                ctx.faults.append(f"rm: {type(v).__name__}: {v}")
                v = 0.0
            node.score = float(v)
            out[i].append(node.score)
        return out


def _mix(*parts: Any) -> int:
    """A deterministic 63-bit seed from parts (``hash`` of str is salted per process)."""
    import hashlib

    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
