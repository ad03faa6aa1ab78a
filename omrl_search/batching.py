"""How the engine fills policy calls: which waiting LM requests go together, in what order,
how a call is made under deadlines, and how its answer is checked.

Every tree's pending ``expand`` / ``ask`` becomes a :class:`LMWait` (its requests and, as they
come back, their generations); :class:`WaitingRequests` holds the requests of all trees in the
order they were issued. Two schedules take from it:

* ``continuous`` (default): each policy call holds the oldest waiting request and fills up to
  the policy's ``max_batch`` sequences (a request is never split) with other waiting requests:
  with ``prefix_order`` its neighbours in prompt order (the same task's siblings and prompts of
  the same shape: shared prefixes, little padding), else the next oldest. A tree resumes as soon
  as its own requests are answered, so its next requests join the very next call instead of
  waiting for the slowest tree of a round; since every call serves the oldest request, none
  waits for ever.
* ``lockstep``: one round serves every waiting request (in calls of ``max_batch``) and only then
  resumes any tree: one call per round for all trees, as rStar-Math describes.

With ``prefix_order`` the requests of a call (of a whole round under ``lockstep``) are sorted by
their prompt token ids, so siblings and requests of the same task sit next to each other: the
backends' prefix reuse (a prefix shared by a chunk prefilled once in ``hf``, the KV stream with
the longest shared prefix in ``llamacpp``, automatic prefix caching in vLLM) then finds them.
Neither choice changes any result: a request's sampling seed comes from its own tree and node.

Every answer is checked before the engine uses it (:func:`well_formed`, :func:`checked_scores`):
a malformed one is a fault of its request, never an exception out of the search. Scorings
(``ctx.score_actions``) are served together in one ``Policy.score`` call (:func:`serve_scores`).

Time limits: when a request has a deadline (its search's ``seconds`` budget, or the engine's
``lm_timeout``), its policy call runs on a daemon thread (:class:`BackgroundCall`) and the
engine waits only until the deadline; a call past it is abandoned (left to finish in the
background, its answer dropped) and its requests fail with :class:`LMTimeout`.
"""
from __future__ import annotations

import math
import numbers
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .prompts import ConstraintError
from .types import Generation, GenRequest, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .ops import EvaluateOp, Op, ScoreOp, SearchContext
    from .tree import Node

SCHEDULES = ("continuous", "lockstep")


class LMWait:
    """One tree's expand or ask (``op``) waiting on the policy: its ``requests``, what the
    engine keeps per request for the answer (``work``: an expand request's context ids and
    grammar) and, as they come back, the generations (or the exception) of each. A request
    slot that is None is not sent (a node the engine would not expand): its answer is given."""

    __slots__ = ("i", "op", "work", "requests", "gens", "left")

    def __init__(self, i: int, op: "Op", work: list, requests: list["GenRequest | None"],
                 given: Any = None):
        self.i, self.op, self.work, self.requests = i, op, work, requests
        self.gens: list[Any] = [None if r is not None else given for r in requests]
        self.left = sum(r is not None for r in requests)

    def answer(self, slot: int, gens: Any) -> bool:
        """Record request ``slot``'s generations (or its exception); True once all are in."""
        self.gens[slot] = gens
        self.left -= 1
        return not self.left


class Round:
    """One driver step's work: LM requests, evaluations and scorings (by tree). Serving it
    may leave ``pending`` a timed policy call still running for requests whose deadline has
    not passed, and ``unserved`` the requests of later calls, put back to wait."""

    __slots__ = ("lm", "evals", "scores", "pending", "unserved")

    def __init__(self, lm: list[tuple[LMWait, int]], evals: "Sequence[tuple[int, EvaluateOp]]" = (),
                 scores: "Sequence[tuple[int, ScoreOp]]" = ()):
        self.lm, self.evals, self.scores = lm, list(evals), list(scores)
        self.pending: tuple[TimedCall, list[tuple[LMWait, int]]] | None = None
        self.unserved: list[tuple[LMWait, int]] = []


class Crashed:
    """A tree's answer that could not be built (the engine failed on it): ends that search."""

    __slots__ = ("error",)

    def __init__(self, exc: BaseException):
        self.error = f"{type(exc).__name__}: {exc}"


class WaitingRequests:
    """The waiting requests of all trees, oldest first, as ``(LMWait, request index)``."""

    def __init__(self) -> None:
        self._items: deque[tuple[LMWait, int]] = deque()
        self.seqs = 0  # sequences waiting (sum of the requests' ``n``)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, wait: LMWait) -> None:
        for slot, req in enumerate(wait.requests):
            if req is not None:
                self._items.append((wait, slot))
                self.seqs += req.params.n

    def put_back(self, items: list[tuple[LMWait, int]]) -> None:
        """Requests taken but not sent (a call before them is still running), oldest first."""
        for wait, slot in reversed(items):
            self._items.appendleft((wait, slot))
            self.seqs += wait.requests[slot].params.n

    def take(self, cap: int | None, key: Callable[["GenRequest"], Any] | None = None
             ) -> list[tuple[LMWait, int]]:
        """Requests holding up to ``cap`` sequences (all with ``None``): the oldest (alone if it
        is larger than ``cap``), then the next oldest, or with ``key`` (see :func:`prompt_key`)
        its nearest neighbours in key order, the side sharing the longer prefix first."""
        if cap is None or self.seqs <= cap:
            out, self._items, self.seqs = list(self._items), deque(), 0
            return out
        if key is not None:
            return self._take_near_oldest(cap, key)
        out: list[tuple[LMWait, int]] = []
        rest: deque[tuple[LMWait, int]] = deque()
        room = cap
        for item in self._items:
            n = item[0].requests[item[1]].params.n
            if room > 0 and (n <= room or not out):
                out.append(item)
                room -= n
                self.seqs -= n
            else:
                rest.append(item)
        self._items = rest
        return out

    def _take_near_oldest(self, cap: int, key: Callable[["GenRequest"], Any]) -> list[tuple[LMWait, int]]:
        items = list(self._items)
        keys = [key(w.requests[s]) for w, s in items]
        size = [w.requests[s].params.n for w, s in items]
        order = sorted(range(len(items)), key=keys.__getitem__)
        lo = hi = order.index(0)  # the oldest request, always served
        chosen, room = {0}, cap - size[0]
        while room > 0:
            sides = []
            if lo > 0 and size[order[lo - 1]] <= room:
                sides.append((_shared(keys[order[lo - 1]], keys[order[lo]]), -1))
            if hi + 1 < len(order) and size[order[hi + 1]] <= room:
                sides.append((_shared(keys[order[hi + 1]], keys[order[hi]]), 1))
            if not sides:
                break
            if max(sides)[1] < 0:
                lo -= 1
                j = order[lo]
            else:
                hi += 1
                j = order[hi]
            chosen.add(j)
            room -= size[j]
        self._items = deque(item for j, item in enumerate(items) if j not in chosen)
        self.seqs -= cap - room
        return [item for j, item in enumerate(items) if j in chosen]


class LMTimeout(Exception):
    """An LM request abandoned at its deadline (the search's ``seconds`` budget or
    ``lm_timeout``)."""


class BackgroundCall:
    """``fn()`` on a daemon thread: :meth:`wait` until a deadline, then the value (or the
    exception it raised). A call nobody waits for any more finishes on its own; its answer is
    dropped with it."""

    __slots__ = ("_done", "_box", "started")

    def __init__(self, fn: Callable[[], Any]):
        self._done = threading.Event()
        self._box: list[Any] = []
        self.started = time.perf_counter()

        def work() -> None:
            try:
                self._box.append((True, fn()))
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                self._box.append((False, exc))
            finally:
                self._done.set()

        threading.Thread(target=work, daemon=True, name="omrl-lm-call").start()

    def wait(self, until: float | None) -> bool:
        """Wait until the call is done or ``time.perf_counter()`` reaches ``until`` (None: no
        limit); whether it is done."""
        if until is None:
            return self._done.wait()
        return self._done.wait(max(0.0, until - time.perf_counter()))

    def result(self) -> Any:
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


def wait_staged(call: BackgroundCall, deadlines: Sequence[float | None]) -> list[bool]:
    """Wait for ``call`` deadline by deadline: which of ``deadlines`` (one per request of the
    call) passed before it was done. Returns as soon as the call is done or every deadline
    has passed (the call is then abandoned)."""
    expired = [False] * len(deadlines)
    for when in sorted({d for d in deadlines if d is not None}):
        if call.wait(when):
            return expired
        expired = [e or (d is not None and d <= when) for e, d in zip(expired, deadlines)]
        if all(expired):
            return expired
    call.wait(None)
    return expired


def prompt_key(req: "GenRequest") -> Any:
    """Sort key that puts prompts sharing a prefix next to each other: the prompt ids, else the
    chat messages as one sequence of strings."""
    ids = req.prompt_ids
    if ids is not None:
        return (0, ids if isinstance(ids, list) else list(ids))
    return (1, [part for m in req.messages for part in (m.get("role", ""), m.get("content", ""))])


def _shared(a: Any, b: Any) -> int:
    """How many leading items two :func:`prompt_key` keys share (-1: different kinds)."""
    if a[0] != b[0]:
        return -1
    n = 0
    for x, y in zip(a[1], b[1]):
        if x != y:
            break
        n += 1
    return n


# --- making a call and checking its answer --------------------------------------------------------
def timeout(call: BackgroundCall | None, at: float | None = None) -> LMTimeout:
    """The fault of a request given up on at ``at`` (default now) while ``call`` ran."""
    took = f" after {(at or time.perf_counter()) - call.started:.2f}s" if call is not None else ""
    return LMTimeout(f"LM call abandoned{took}: past the search's seconds budget or lm_timeout")


def call_policy(generate: Callable[[list["GenRequest"]], Any], chunk: list["GenRequest"],
                deadlines: Sequence[float | None]) -> list[Any]:
    """``generate(chunk)``: per request its generations or the exception it failed with. A
    failed call is retried one request at a time, so a bad request fails alone. With
    deadlines it is a :class:`TimedCall` waited for to the end."""
    if not chunk:
        return []
    if any(d is not None for d in deadlines):
        return TimedCall(generate, chunk, deadlines).advance(until_end=True)
    try:
        return _checked(generate(chunk), len(chunk))
    except Exception as exc:
        return _alone(generate, chunk, deadlines, exc)


def _checked(gens: Any, n: int) -> list[Any]:
    if not isinstance(gens, (list, tuple)) or len(gens) != n:
        got = f"{len(gens)} results" if isinstance(gens, (list, tuple)) else type(gens).__name__
        raise RuntimeError(f"policy returned {got} for {n} requests")
    return list(gens)


def _alone(generate: Callable, chunk: list["GenRequest"], deadlines: Sequence[float | None],
           exc: Exception) -> list[Any]:
    """After a failed call: ``exc`` for a lone request, else each request called alone."""
    if len(chunk) == 1:
        return [exc]
    return [call_policy(generate, [r], [d])[0] for r, d in zip(chunk, deadlines)]


#: what :meth:`TimedCall.advance` gives a request not settled by this call of it
NOT_YET = object()


class TimedCall:
    """A policy call whose requests have deadlines, run on a thread (:class:`BackgroundCall`).

    :meth:`advance` waits until the call ends or the next deadline passes and settles what it
    can: a request past its deadline fails with :class:`LMTimeout` (one already past it is not
    sent at all), the others get their answer when the call ends. A call whose requests are
    all settled by their deadlines is abandoned: it finishes in the background, unread."""

    __slots__ = ("generate", "chunk", "deadlines", "settled", "live", "call")

    def __init__(self, generate: Callable[[list["GenRequest"]], Any], chunk: list["GenRequest"],
                 deadlines: Sequence[float | None]):
        self.generate, self.chunk, self.deadlines = generate, chunk, list(deadlines)
        now = time.perf_counter()
        self.live = [j for j, d in enumerate(deadlines) if d is None or d > now]
        self.settled = [False] * len(chunk)
        live = [chunk[j] for j in self.live]
        self.call = BackgroundCall(lambda: generate(live)) if live else None

    @property
    def done(self) -> bool:
        return all(self.settled)

    def advance(self, until_end: bool = False) -> list[Any]:
        """Wait for the next deadline (``until_end``: for every one) or the call's end; per
        request the answer settled now, or :data:`NOT_YET` (settled before, or still waiting)."""
        out: list[Any] = [NOT_YET] * len(self.chunk)
        for j in set(range(len(self.chunk))) - set(self.live):
            if not self.settled[j]:
                out[j], self.settled[j] = LMTimeout("the search's time was up before the LM call"), True
        while not self.done:
            todo = [j for j in self.live if not self.settled[j]]
            when = min((self.deadlines[j] for j in todo if self.deadlines[j] is not None), default=None)
            if self.call.wait(when):
                for j, answer in zip(todo, self._answers(todo)):
                    out[j], self.settled[j] = answer, True
                break
            for j in todo:
                d = self.deadlines[j]
                if d is not None and d <= when:
                    out[j], self.settled[j] = timeout(self.call, d), True
            if not until_end:
                break
        return out

    def _answers(self, todo: list[int]) -> list[Any]:
        """The finished call's answers of requests ``todo`` (a failed call: each retried)."""
        try:
            gens = _checked(self.call.result(), len(self.live))
        except Exception as exc:
            return _alone(self.generate, [self.chunk[j] for j in todo],
                          [self.deadlines[j] for j in todo], exc)
        by_index = dict(zip(self.live, gens))
        return [by_index[j] for j in todo]


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _count(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


def _all_counts(xs: Any) -> bool:
    """A list or tuple of non-negative integers."""
    return isinstance(xs, (list, tuple)) and all(_count(x) for x in xs)


def _all_reals(xs: Any) -> bool:
    return isinstance(xs, (list, tuple)) and all(_real(x) for x in xs)


def finite_logprobs(lps: "Sequence[float]") -> bool:
    """No NaN and no +inf among ``lps`` (``-inf``, a token of probability zero, is a number a
    logprob can be); a generation with either is malformed: its node's fault."""
    return not any(x != x or x == math.inf for x in lps)


def _malformed(g: Any) -> str:
    """What is wrong with one generation ("" if nothing)."""
    if not isinstance(g, Generation):
        return f"a {type(g).__name__} instead of a Generation"
    if not isinstance(g.text, str):
        return f"generation text is {type(g.text).__name__}, not str"
    if g.token_ids is not None and not _all_counts(g.token_ids):
        return "generation token_ids are not a list of token ids"
    if g.logprobs is not None and not _all_reals(g.logprobs):
        return "generation logprobs are not a list of numbers"
    if g.logprobs is not None and not finite_logprobs(g.logprobs):
        return "generation logprobs are not finite (NaN or +inf)"
    if not (_count(g.prompt_tokens) and _count(g.completion_tokens)):
        return f"generation usage is not token counts ({g.prompt_tokens!r}, {g.completion_tokens!r})"
    return ""


def well_formed(gens: Any, n: int) -> tuple[list[Generation], list[str]]:
    """The well-formed generations of a policy's answer to one request for ``n``, and what was
    wrong with the rest: an answer that is not a list; an item that is not a
    :class:`~omrl_search.types.Generation`, or whose ``text`` is not a str, ``token_ids`` not
    token ids, ``logprobs`` not numbers or not finite (NaN, +inf), usage not token counts;
    fewer (or more) than ``n``."""
    if not isinstance(gens, (list, tuple)):
        return [], [f"policy answered a request with {type(gens).__name__}, not a list of generations"]
    good, problems = [], []
    for g in gens:
        why = _malformed(g)
        if why:
            problems.append(why)
        else:
            good.append(g)
    if len(gens) != n:
        problems.append(f"policy gave {len(gens)} generations for n={n}")
        good = good[:n]
    return good, problems


def checked_scores(raw: Any, n: int) -> list[float] | Exception:
    """``raw`` (``Policy.score``'s answer for one request) as ``n`` logprobs (real numbers or
    ``-inf``), else an exception saying what is wrong."""
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        return RuntimeError(f"policy.score gave {type(raw).__name__} for {n} completions")
    if not all(_real(x) for x in raw) or not finite_logprobs(raw):
        return RuntimeError("policy.score gave a score that is not finite (NaN or +inf) or not a number")
    return [float(x) for x in raw]


# --- scoring given completions (policy priors) ------------------------------------------------------
def _score_request(ctx: "SearchContext", node: "Node") -> GenRequest:
    """The request whose completions ``Policy.score`` scores: ``node``'s step prompt (with the
    grammar an expansion there would carry)."""
    messages, _, prompt_ids = ctx.prompts.step(node)
    grammar = ctx.constraint.grammar(node, count=False)[0] if ctx.constraint is not None else None
    meta = {"task": ctx.task, "snapshot": node.snapshot, "env": ctx.task.env, "score": True}
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=0, stop=(), n=1, seed=None)
    return GenRequest(messages, params, prompt_ids, meta, grammar)


def serve_scores(policy: Any, ops: "list[tuple[int, ScoreOp]]") -> dict[int, Any]:
    """Every pending scoring in one ``policy.score(requests, completions)`` call: per tree, per
    node, the total logprob of each completion. Each node's prompt is one request (its
    completions share it) charged one LM call and the tokens read (of its prompt, those the
    backend's prefix cache served as ``cached_tokens``: ``Policy.last_score_cached``); a failed call scores every
    completion 0 (uniform priors) and is a fault of each search."""
    flat, requests, out = [], [], {}
    for i, op in ops:
        try:
            built = [_score_request(op.ctx, node) for node in op.nodes]
        except ConstraintError:
            raise
        except Exception as exc:  # a prompt that cannot be built ends its own search
            out[i] = Crashed(exc)
            continue
        out[i] = []
        flat += [(i, op.ctx, comps) for comps in op.completions]
        requests += built
    if not flat:
        return out
    try:
        got = policy.score(requests, [comps for *_, comps in flat])
        if not isinstance(got, (list, tuple)) or len(got) != len(flat):
            raise RuntimeError(f"policy.score returned {type(got).__name__} for {len(flat)} requests")
    except Exception as exc:
        got = [exc] * len(flat)
    served = getattr(policy, "last_score_cached", None)  # prompt tokens its prefix cache served
    if not isinstance(served, list) or len(served) != len(flat):
        served = [0] * len(flat)
    for (i, ctx, comps), req, scores, cached in zip(flat, requests, got, served):
        ctx.budget.charge_scoring(len(req.prompt_ids or ())
                                  + sum(len(ctx.prompts.encode(c)) for c in comps), cached)
        if not isinstance(scores, Exception):
            scores = checked_scores(scores, len(comps))
        if isinstance(scores, Exception):
            ctx.faults.append(f"lm score: {type(scores).__name__}: {scores}")
            scores = [0.0] * len(comps)
        out[i].append(scores)
    return out
