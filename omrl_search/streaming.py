"""Serving a policy that batches continuously itself (``Policy.streams``: vLLM's engine, an
OpenAI-compatible server): each request is submitted as soon as its tree makes it and joins the
sequences already decoding; answers are collected as they finish (docs/design.md §4).

One job: the requests in flight, by ticket, with their deadlines. When to submit, collect or
serve evaluations instead stays with the scheduler (:class:`~omrl_search.scheduler.Run`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .batching import BackgroundCall, LMWait, prompt_key, timeout, wait_staged

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


class StreamingCalls:
    """The streaming requests of one run: submitted, not yet answered (``inflight``: wait,
    slot and deadline by ticket), and a timed ``collect()`` still running (``collecting``)."""

    __slots__ = ("engine", "inflight", "collecting")

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.inflight: dict[int, tuple[LMWait, int, float | None]] = {}
        self.collecting: BackgroundCall | None = None

    def submit(self, items: list[tuple[LMWait, int]]) -> list[tuple[int, Any]]:
        """Submit ``items`` (in prompt order with ``prefix_order``); a submission that fails
        fails each of its requests alone: those failures, by ticket (else nothing)."""
        engine = self.engine
        if engine.prefix_order:
            items = sorted(items, key=lambda item: prompt_key(item[0].requests[item[1]]))
        tickets = []
        for wait, slot in items:
            ticket = engine.next_ticket()
            self.inflight[ticket] = (wait, slot, engine.deadline(wait))
            tickets.append((ticket, wait.requests[slot]))
        try:
            engine.policy.submit(tickets)
        except Exception as exc:
            return [(t, exc) for t, _ in tickets]
        return []

    def collect(self) -> list[tuple[int, Any]]:
        """The policy's ``collect()``; with deadlines on a thread (one at a time: a collect
        abandoned earlier is waited on again), waited for until the in-flight requests'
        deadlines: those past theirs fail with LMTimeout. A collect that raises fails every
        request in flight."""
        policy, inflight = self.engine.policy, self.inflight
        deadlines = [d for _, _, d in inflight.values()]
        try:
            if self.collecting is None and all(d is None for d in deadlines):
                done = policy.collect()
            else:
                call = self.collecting or BackgroundCall(policy.collect)
                expired = wait_staged(call, deadlines)
                late = {t: d for (t, (_, _, d)), e in zip(inflight.items(), expired) if e}
                fail = [(t, timeout(call, d)) for t, d in late.items()]
                if late and len(late) == len(inflight):  # left running; looked at again next time
                    self.collecting = call
                    return fail
                self.collecting = None
                done = [(t, g) for t, g in call.result() if t not in late] + fail
        except Exception as exc:
            self.collecting = None
            return [(t, exc) for t in inflight]
        if not done:
            raise RuntimeError("engine: a streaming policy's collect() returned nothing")
        return done

    def answers(self, done: list[tuple[int, Any]]) -> dict[int, Any]:
        """The answers of the ops that ``done`` (generations or an exception, by ticket)
        completes, by tree; a ticket answered after its request was abandoned is dropped."""
        answers: dict[int, Any] = {}
        for ticket, gens in done:
            entry = self.inflight.pop(ticket, None)
            if entry is None:
                continue
            wait, slot, _ = entry
            if wait.answer(slot, gens):
                answers[wait.i] = self.engine.answer(wait)
        return answers
