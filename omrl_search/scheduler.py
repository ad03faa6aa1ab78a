"""One :meth:`~omrl_search.engine.Engine.run`: the driver loop that keeps many searches moving.

Its one job is *when*: it starts tasks up to the run's concurrency, resumes each tree's
coroutine with the answer to its last op, queues the op it yields next (LM requests,
evaluations, scorings), and chooses what is served next: one policy call's worth
(``continuous``), everything (``lockstep``), or submit/collect with a streaming backend. It
drives the engine through its public face only: ``start`` / ``result`` a search,
``requests_for`` an op, ``serve`` / ``deliver`` / ``evaluate_all`` what it chose,
``answer`` an op whose requests are all answered (see docs/design.md §5).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .batching import Crashed, LMWait, Round, TimedCall, WaitingRequests, prompt_key
from .budget import Budget, BudgetExhausted
from .ops import EvaluateOp, ScoreOp, SearchContext
from .prompts import ConstraintError
from .result import SearchResult
from .streaming import StreamingCalls
from .types import Task

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


class Run:
    """One :meth:`Engine.run`: the tasks not yet started, the live searches (context and
    coroutine) and what each waits on; :meth:`loop` serves them until every task has a result."""

    __slots__ = ("engine", "strategy", "budget", "on_result", "queue", "results", "limit", "live",
                 "waiting", "evals", "scores", "ready", "streaming", "pending", "spec")

    def __init__(self, engine: "Engine", strategy: Any, tasks: Iterable[Task], budget: Budget,
                 concurrency: int | None, on_result: Callable[[SearchResult], None] | None):
        self.engine, self.strategy, self.budget, self.on_result = engine, strategy, budget, on_result
        self.spec: str = strategy.spec()  # every result's ``strategy``, made once per run
        self.queue = deque(enumerate(tasks))
        self.results: list[SearchResult | None] = [None] * len(self.queue)
        self.limit = concurrency or len(self.queue) or 1
        self.live: dict[int, tuple[SearchContext, Any]] = {}
        self.waiting = WaitingRequests()  # LM requests not yet sent
        self.evals: dict[int, EvaluateOp] = {}  # evaluations not yet served, by tree
        self.scores: dict[int, ScoreOp] = {}  # scorings not yet served, by tree
        self.ready: list[tuple[int, Any]] = []  # trees to resume at once (an op with no requests)
        # a policy that batches continuously itself gets each request as soon as it is made
        streams = engine.schedule == "continuous" and bool(getattr(engine.policy, "streams", False))
        self.streaming = StreamingCalls(engine) if streams else None
        self.pending: tuple[TimedCall, list[tuple[LMWait, int]]] | None = None  # a timed call running

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
            inflight = self.streaming is not None and self.streaming.inflight
            if not (self.waiting or self.evals or self.scores or inflight or self.pending):
                if self.live:  # every live search waits on something: a driver bug
                    raise RuntimeError("engine: live searches with nothing to serve")
                continue
            if self.pending is not None:
                answers = self.resume()
            elif self.streaming is not None:
                answers = self.stream()
            else:
                step = self.next_step()
                answers = engine.serve(step)
                self.pending = step.pending
                self.waiting.put_back(step.unserved)
            for i in sorted(answers):
                self.advance(i, answers[i])
        return self.results  # type: ignore[return-value]

    def start(self, i: int, task: Task) -> None:
        started = self.engine.start(self.strategy, task, self.budget, self.spec)
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
        result = self.engine.result(self.strategy, ctx, stop, self.spec)
        ctx.envs.close()
        self.done(i, result)

    def advance(self, i: int, value: Any) -> None:
        """Resume tree ``i`` with ``value`` and queue the op it yields next."""
        ctx, coro = self.live[i]
        if type(value) is Crashed:  # the engine failed building this tree's answer
            coro.close()
            ctx.faults.append(f"engine: {value.error}")
            self.finish(i, "error")
            return
        try:
            op = coro.send(value)
        except StopIteration:
            self.finish(i, "done")
        except BudgetExhausted as exc:
            self.finish(i, exc.stop_reason)
        except Exception as exc:  # a crashing strategy loses only its own task
            ctx.faults.append(f"strategy: {type(exc).__name__}: {exc}")
            self.finish(i, "error")
        else:
            if type(op) is EvaluateOp:
                self.evals[i] = op
                return
            if type(op) is ScoreOp:
                self.scores[i] = op
                return
            try:
                wait = self.engine.requests_for(i, op)
            except ConstraintError:  # a setting that cannot be honoured: the run's error
                coro.close()
                raise
            except Exception as exc:  # a prompt that cannot be built ends its own search
                coro.close()
                ctx.faults.append(f"engine: {type(exc).__name__}: {exc}")
                self.finish(i, "error")
                return
            if wait.left:
                self.waiting.add(wait)
            else:
                self.ready.append((i, self.engine.answer(wait)))

    def resume(self) -> dict[int, Any]:
        """Wait on the timed call still running (to its next deadline or its end)."""
        timed, items = self.pending  # type: ignore[misc]
        got = timed.advance()
        if timed.done:
            self.pending = None
        answers: dict[int, Any] = {}
        self.engine.deliver(items, got, answers)
        return answers

    def next_step(self) -> Round:
        """What the engine serves next: LM requests taken from ``waiting`` and evaluations
        taken from ``evals``. ``lockstep``: everything. ``continuous``: the pending evaluations
        while fewer than ``max_batch`` sequences wait (their trees may top the next call up),
        else one policy call's worth: the oldest request and (``prefix_order``) its neighbours
        in prompt order, or the next oldest."""
        engine, waiting = self.engine, self.waiting
        if engine.schedule == "lockstep":
            return Round(waiting.take(None), *self.side_work())
        if (self.evals or self.scores) and waiting.seqs < engine.policy.max_batch:
            return Round([], *self.side_work())
        return Round(waiting.take(engine.policy.max_batch, prompt_key if engine.prefix_order else None))

    def side_work(self) -> tuple[list[tuple[int, EvaluateOp]], list[tuple[int, ScoreOp]]]:
        """The pending evaluations and scorings, taken."""
        ev, sc = list(self.evals.items()), list(self.scores.items())
        self.evals.clear()
        self.scores.clear()
        return ev, sc

    def stream(self) -> dict[int, Any]:
        """One driver step with a streaming backend: submit every waiting request (the backend's
        scheduler adds them to what is running), then serve the pending evaluations and
        scorings, or else collect the requests done so far. Returns the answers of the ops now
        complete."""
        done = self.streaming.submit(self.waiting.take(None)) if self.waiting else []
        if (self.evals or self.scores) and not done:
            return self.engine.serve(Round([], *self.side_work()))
        return self.streaming.answers(done or self.streaming.collect())
