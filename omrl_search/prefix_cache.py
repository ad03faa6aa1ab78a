"""The prefix cache across calls, shared by the in-process ``hf`` backend and the learned reward
models (:mod:`reward_models.prefix_scoring`): a radix tree over token ids
whose nodes hold the KV cache of their run of tokens (as SGLang's RadixAttention and vLLM's
automatic prefix caching do).

A search asks again and again for prompts that extend each other (a child's prompt is its
parent's prompt, the parent's completion and one observation turn), so most of every prompt
was already run through the model. :meth:`RadixCache.lookup` gives the longest cached prefix
of a prompt and its keys/values, so only the rest is prefilled; :meth:`RadixCache.insert`
stores a sequence's KV (only the part not already in the tree). The tree is bounded by a
memory limit: over it, the least recently used *leaves* are evicted first (a node's prefix
stays while a longer sequence under it is still in use).

A node's KV is one tensor ``(layers, 2, kv_heads, tokens, head_dim)`` (keys and values,
rotary embeddings already applied at the tokens' absolute positions, so a cached prefix is
valid for any suffix). Nothing here imports torch; the tensors come from the backend.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence



def common_prefix(a: Sequence[int], b: Sequence[int], cap: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (both lists or both tuples), at
    most ``cap``: slices compared in C, bisected (both backends' prefix caches use it)."""
    n = min(len(a), len(b), cap)
    if n <= 0:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def cache_limit(on: Any, mb: Any) -> float | None:
    """The ``prefix_cache`` / ``prefix_cache_mb`` options (``on``/``off``/``true``/``false`` or a
    bool; MiB > 0) as the cache's limit in MiB, None when off; ValueError naming the bad one."""
    if isinstance(on, str) and on.lower() in ("on", "off", "true", "false"):
        on = on.lower() in ("on", "true")
    if not isinstance(on, bool) and on not in (0, 1):
        raise ValueError(f"prefix_cache must be on or off (got {on!r})")
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
        raise ValueError(f"prefix_cache_mb must be a number of MiB > 0 (got {mb!r})")
    return float(mb) if on else None


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last", "nbytes")

    def __init__(self, tokens: list[int], kv: Any, parent: "_Node | None") -> None:
        self.tokens = tokens
        self.kv = kv
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last = 0
        self.nbytes = 0 if kv is None else kv.numel() * kv.element_size()


class RadixCache:
    """Token-id prefixes -> their KV, bounded by ``limit_mb`` MiB with LRU eviction of leaves.

    Counters (:meth:`stats`): ``lookups`` (prompts looked up), ``hits`` (of them, with a cached
    prefix), ``queried_tokens`` / ``hit_tokens`` (prompt tokens looked up / served from the
    cache; ``hit_rate`` is their ratio), ``inserted_tokens``, ``evicted_tokens``, ``bytes``."""

    def __init__(self, limit_mb: float) -> None:
        if not limit_mb > 0:
            raise ValueError(f"prefix cache limit must be > 0 MB (got {limit_mb})")
        self.limit = int(float(limit_mb) * (1 << 20))
        self.clear()

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        self.root = _Node([], None, None)
        self.bytes = 0
        self._clock = 0
        self.counts = dict.fromkeys(("lookups", "hits", "queried_tokens", "hit_tokens",
                                     "inserted_tokens", "evicted_tokens"), 0)

    # --- reading ---------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], limit: int) -> tuple[int, list[tuple[_Node, int]]]:
        """How many of ``tokens[:limit]`` (a list, like the nodes' tokens) the tree holds, and
        the nodes on that path with how many of each node's tokens are used (the last may be
        used in part)."""
        node, i, path = self.root, 0, []
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix(child.tokens, tokens[i:limit], limit - i)
            path.append((child, n))
            i += n
            if n < len(child.tokens):
                break
            node = child
        return i, path

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` are cached (no LRU update, not counted)."""
        return self._walk(tokens, len(tokens))[0]

    def lookup(self, tokens: Sequence[int], max_len: int | None = None,
               min_len: int = 1) -> tuple[int, list[Any]]:
        """The longest cached prefix of ``tokens`` (at most ``max_len`` tokens; one shorter
        than ``min_len`` counts as none): its length and its KV as a list of pieces
        ``(layers, 2, kv_heads, n_i, head_dim)`` to be joined along the token axis (views
        into the tree, valid until the next :meth:`insert`). Marks the path as just used."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        n, path = self._walk(tokens, limit)
        self.counts["lookups"] += 1
        self.counts["queried_tokens"] += len(tokens)
        if n == 0 or n < min_len:
            return 0, []
        self.counts["hits"] += 1
        self.counts["hit_tokens"] += n
        self._touch(node for node, _ in path)
        return n, [node.kv[..., :used, :] for node, used in path]

    # --- writing ---------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], kv_of: Callable[[int, int], Any]) -> int:
        """Store ``tokens``' KV; ``kv_of(start, end)`` gives the KV of ``tokens[start:end]``
        and is called only for the part the tree does not hold yet. Returns how many tokens
        were added; then evicts down to the limit."""
        tokens = list(tokens)
        n, path = self._walk(tokens, len(tokens))
        parent = self.root
        if path:
            node, used = path[-1]
            parent = self._split(node, used) if used < len(node.tokens) else node
            path[-1] = (parent, used)
        touched = [node for node, _ in path]
        added = 0
        if n < len(tokens):
            kv = kv_of(n, len(tokens))
            leaf = _Node(tokens[n:], kv.contiguous().clone(), parent)
            parent.children[tokens[n]] = leaf
            self.bytes += leaf.nbytes
            added = len(tokens) - n
            self.counts["inserted_tokens"] += added
            touched.append(leaf)
        self._touch(touched)
        self._evict()
        return added

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; the new upper half (returned) takes its place."""
        parent = node.parent
        upper = _Node(node.tokens[:at], node.kv[..., :at, :].clone(), parent)
        upper.last = node.last
        lower_kv = node.kv[..., at:, :].clone()
        node.tokens, node.kv, node.parent = node.tokens[at:], lower_kv, upper
        self.bytes -= node.nbytes
        node.nbytes = lower_kv.numel() * lower_kv.element_size()
        self.bytes += node.nbytes + upper.nbytes
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper  # type: ignore[union-attr]
        return upper

    def _touch(self, nodes: Any) -> None:
        self._clock += 1
        for node in nodes:
            node.last = self._clock

    def _evict(self) -> None:
        """Remove least recently used leaves until the tree fits the limit (a parent left
        without children becomes a leaf and may go next)."""
        if self.bytes <= self.limit:
            return
        heap, stack, serial = [], list(self.root.children.values()), 0
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                heap.append((node.last, serial, node))
                serial += 1
        heapq.heapify(heap)
        while self.bytes > self.limit and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[0]]  # type: ignore[union-attr]
            self.bytes -= node.nbytes
            self.counts["evicted_tokens"] += len(node.tokens)
            if parent is not self.root and not parent.children:  # type: ignore[union-attr]
                serial += 1
                heapq.heappush(heap, (parent.last, serial, parent))  # type: ignore[union-attr]

    # --- reporting -------------------------------------------------------------------------
    def nodes(self) -> int:
        """How many nodes the tree holds (the root excluded)."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def stats(self) -> dict[str, Any]:
        c = dict(self.counts)
        c["hit_rate"] = round(c["hit_tokens"] / c["queried_tokens"], 4) if c["queried_tokens"] else 0.0
        c["bytes"] = self.bytes
        c["limit_bytes"] = self.limit
        return c
