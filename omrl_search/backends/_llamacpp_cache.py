"""Saved KV states of llama.cpp sequences, for the ``llamacpp`` backend's prefix cache.

The backend keeps ``max_batch`` KV streams alive between calls and starts a new prompt from the
stream that shares its longest prefix; this store holds what would otherwise be lost when a
stream is overwritten: the sequence's state (``llama_state_seq_get_data``: its KV cells, about
23 KB per token for SmolLM2-135M) keyed by the exact token ids it holds, in LRU order, bounded
in bytes. A later prompt that shares a longer prefix with a saved state than with any live stream
gets that state copied back into a stream (``llama_state_seq_set_data``), the tail past the
shared prefix is dropped, and only the rest is evaluated. Copying 25 MB costs milliseconds;
prefilling the 1,000 tokens it holds costs seconds on a CPU.

llama.cpp saves and restores a sequence whole (no partial ranges), so entries that share a long
prefix (a search tree's branches) each hold their own copy of it; an entry that is a prefix of
a newer one is dropped, as the newer one serves every prompt the older did.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any, Sequence

from ..prefix_cache import common_prefix


class SeqStateStore:
    """LRU of saved sequence states keyed by their token ids, at most ``limit_bytes`` in all.

    ``min_tokens``: a state is saved only when at least this many of its tokens would be lost,
    and restored only when it serves at least this many tokens more than a live stream does.
    """

    def __init__(self, ll: Any, ctx: Any, limit_bytes: int, min_tokens: int = 32) -> None:
        self._ll, self._ctx = ll, ctx
        self.limit_bytes = int(limit_bytes)
        self.min_tokens = int(min_tokens)
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # ids -> ctypes buffer
        self.bytes = 0
        self.saves = self.restores = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def best(self, prompt: Sequence[int], cap: int) -> tuple[int, tuple[int, ...] | None]:
        """The saved state sharing the longest prefix (at most ``cap``) with ``prompt``:
        (that length, its key), or (0, None)."""
        top: tuple[int, tuple[int, ...] | None] = (0, None)
        prompt = tuple(prompt)  # a list never equals a tuple
        for key in self._entries:
            n = common_prefix(prompt, key, cap)
            if n > top[0]:
                top = (n, key)
        return top

    def covers(self, ids: Sequence[int]) -> bool:
        """Whether a saved state already holds ``ids`` (or more after them)."""
        n = len(ids)
        return any(len(k) >= n and k[:n] == tuple(ids) for k in self._entries)

    def save(self, seq: int, ids: Sequence[int]) -> bool:
        """Save sequence ``seq`` (holding exactly ``ids``); entries it extends are dropped, then
        the least recently used ones until the store fits its limit. False when it cannot fit."""
        key = tuple(ids)
        if len(key) < self.min_tokens or self.limit_bytes <= 0 or self.covers(key):
            return False
        ll, ctx = self._ll, self._ctx
        size = int(ll.llama_state_seq_get_size(ctx, seq))
        if size <= 0 or size > self.limit_bytes:
            return False
        buf = (ctypes.c_uint8 * size)()
        got = int(ll.llama_state_seq_get_data(ctx, buf, size, seq))
        if got <= 0:
            return False
        for k in [k for k in self._entries if len(k) < len(key) and key[:len(k)] == k]:
            self._drop(k)
        while self._entries and self.bytes + size > self.limit_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[key] = (buf, got)
        self.bytes += size
        self.saves += 1
        return True

    def restore(self, key: tuple[int, ...], seq: int) -> bool:
        """Load the state saved under ``key`` into sequence ``seq`` (which must be empty)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        buf, size = entry
        ok = int(self._ll.llama_state_seq_set_data(self._ctx, buf, size, seq)) > 0
        if ok:
            self._entries.move_to_end(key)
            self.restores += 1
        else:
            self._drop(key)
        return ok

    def _drop(self, key: tuple[int, ...]) -> None:
        buf, _ = self._entries.pop(key)
        self.bytes -= ctypes.sizeof(buf)
