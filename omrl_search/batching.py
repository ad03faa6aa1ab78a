"""How the engine fills policy calls: which waiting LM requests go together, in what order.

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
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from .ops import Op
    from .types import GenRequest

SCHEDULES = ("continuous", "lockstep")


class LMWait:
    """One tree's expand or ask (``op``) waiting on the policy: its ``requests``, what the
    engine keeps per request for the answer (``work``: an expand request's context ids) and,
    as they come back, the generations (or the exception) of each."""

    __slots__ = ("i", "op", "work", "requests", "gens", "left")

    def __init__(self, i: int, op: "Op", work: list, requests: list["GenRequest"]):
        self.i, self.op, self.work, self.requests = i, op, work, requests
        self.gens: list[Any] = [None] * len(requests)
        self.left = len(requests)

    def answer(self, slot: int, gens: Any) -> bool:
        """Record request ``slot``'s generations (or its exception); True once all are in."""
        self.gens[slot] = gens
        self.left -= 1
        return not self.left


class WaitingRequests:
    """The waiting requests of all trees, oldest first, as ``(LMWait, request index)``."""

    def __init__(self) -> None:
        self._items: deque[tuple[LMWait, int]] = deque()
        self.seqs = 0  # sequences waiting (sum of the requests' ``n``)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, wait: LMWait) -> None:
        for slot, req in enumerate(wait.requests):
            self._items.append((wait, slot))
            self.seqs += req.params.n

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
