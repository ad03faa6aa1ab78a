"""Scoring search prefixes with a cache across calls, so a child's score costs only its new tokens.

A search hands the reward model every new node's whole episode (prompt, every step, every
observation), and a child's episode is its parent's plus one completion and one observation
turn. The model is causal, so (1) the score read at position ``p`` depends on ``ids[:p + 1]``
alone, and (2) the keys/values of a shared prefix are the same for every episode that extends it.
:class:`PrefixScorer` keeps both:

* a **memo** of read logits keyed by a digest of ``ids[:p + 1]`` (LRU, bounded in entries): the
  parent's steps are not read again;
* a **KV radix cache** (:class:`~omrl_search.prefix_cache.RadixCache`, the ``hf``
  policy backend's, bounded in MiB with LRU eviction): only the tokens after the longest cached
  prefix go through the backbone.

Both are dropped when the weights change (a training step, ``load_weights``) or the autocast
state differs from the one they were filled under: they are keyed by a checksum of the weights
(each parameter's sum: 9 ms a call for a 57M-parameter PRM on 2 cores, beside forwards of tens
to hundreds of ms). Scores equal an uncached forward up to float rounding (tested to 1e-4).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Sequence

from omrl_search.prefix_cache import RadixCache, common_prefix

#: memory bound of the KV cache (MiB) and of the memo (read positions) by default
DEFAULT_CACHE_MB = 512
DEFAULT_MEMO_ENTRIES = 1 << 18
#: the fewest tokens rows must share, beyond their cached prefix, to be forwarded once for all
MIN_SHARED = 8


def prefix_digests(ids: Sequence[int], positions: Sequence[int]) -> list[bytes]:
    """A digest of ``ids[:p + 1]`` for every ``p`` in ``positions`` (one pass over ``ids``)."""
    h = hashlib.blake2b(digest_size=16)
    out, done = [], 0
    for p in positions:
        if p + 1 < done:  # a position before one already read (a cut episode): hash afresh
            out.append(hashlib.blake2b(array("q", ids[:p + 1]).tobytes(), digest_size=16).digest())
            continue
        h.update(array("q", ids[done:p + 1]).tobytes())
        done = p + 1
        out.append(h.copy().digest())
    return out


class PrefixScorer:
    """Per-step logits of encoded episodes through a :class:`~reward_models._net.ValueHeadModel`,
    reusing the memo and the KV cache (see the module docstring). Counters in :meth:`stats`."""

    def __init__(self, limit_mb: float = DEFAULT_CACHE_MB, memo_entries: int = DEFAULT_MEMO_ENTRIES):
        self.kv = RadixCache(limit_mb)
        self.memo_entries = int(memo_entries)
        self.memo: OrderedDict[bytes, float] = OrderedDict()
        self._key: Any = None
        self.counts = dict.fromkeys(("steps", "memo_hits", "tokens", "forwarded_tokens"), 0)

    def clear(self) -> None:
        self.kv.clear()
        self.memo.clear()
        self._key = None
        for k in self.counts:
            self.counts[k] = 0

    def stats(self) -> dict[str, Any]:
        c = dict(self.counts)
        c["forwarded_share"] = round(c["forwarded_tokens"] / c["tokens"], 4) if c["tokens"] else 0.0
        c["kv"] = self.kv.stats()
        return c

    def _check_weights(self, model: Any) -> None:
        import torch

        sums = torch.stack([p.detach().sum(dtype=torch.float32) for p in model.parameters()])
        mode = (torch.is_autocast_enabled("cpu"),
                torch.is_autocast_enabled("cuda") if torch.cuda.is_available() else False)
        if self._key is None or self._key[1] != mode or not torch.equal(self._key[0], sums):
            self.kv.clear()
            self.memo.clear()
            self._key = (sums, mode)

    def logits(self, model: Any, encoded: Sequence[tuple[list[int], list[int]]], batch_size: int,
               pad_id: int) -> tuple[list[list[float]], list[int]]:
        """The logit at every read position of every ``(ids, positions)``, and how many tokens
        each row ran through the model (call under ``torch.inference_mode``, model in eval mode)."""
        self._check_weights(model)
        keys = [prefix_digests(ids, pos) for ids, pos in encoded]
        cost = [0] * len(encoded)
        for r, tokens in self._prime(model, encoded, keys, batch_size, pad_id).items():
            cost[r] += tokens
        out: list[list[float | None]] = []
        work = []  # (row, first step to read, cached length, its KV pieces, last token, keys)
        for r, (ids, pos) in enumerate(encoded):
            got = [self.memo.get(k) for k in keys[r]]
            out.append(got)
            self.counts["steps"] += len(pos)
            self.counts["tokens"] += (max(pos) + 1) if pos else 0
            missing = [j for j, v in enumerate(got) if v is None]
            self.counts["memo_hits"] += len(pos) - len(missing)
            for j, v in enumerate(got):
                if v is not None:
                    self.memo.move_to_end(keys[r][j])
            if not missing:
                continue
            j0 = missing[0]
            last = max(pos[j0:])
            n, parts = self.kv.lookup(ids[:last + 1], max_len=min(pos[j0:]))
            work.append((r, j0, n, parts, last, keys[r]))
        work.sort(key=lambda w: w[4] + 1 - w[2])  # rows with as many new tokens together
        for start in range(0, len(work), batch_size):
            self._forward(model, encoded, work[start:start + batch_size], out, pad_id)
        for r, _, n, _, last, _ in work:
            cost[r] += last + 1 - n
        self.counts["forwarded_tokens"] += sum(cost)
        return out, cost  # type: ignore[return-value]

    def _prime(self, model: Any, encoded: Sequence[tuple[list[int], list[int]]],
               keys: Sequence[list[bytes]], batch_size: int, pad_id: int) -> dict[int, int]:
        """Forward once every prefix that two or more rows share beyond what the caches hold:
        its KV goes into the KV cache and the steps it reads into the memo, so siblings scored
        together (a node's children; the first children of a root, which is never scored
        itself) then run only their own tokens. Prefixes shared among those prefixes go first
        (recursively). Returns the tokens forwarded, by the index of the first row sharing each
        prefix (the row that pays for it)."""
        rows = []  # (tokens up to the row's last read not in the memo, row index)
        for r, (ids, pos) in enumerate(encoded):
            todo = [p for p, k in zip(pos, keys[r]) if k not in self.memo]
            if todo:
                rows.append((ids[:max(todo) + 1], r))
        if len(rows) < 2:
            return {}
        rows.sort()
        held = {r: self.kv.lookup(t)[0] for t, r in rows}  # what the KV cache holds of each row
        found: dict[tuple[int, ...], int] = {}
        for (ta, a), (tb, b) in zip(rows, rows[1:]):
            n = common_prefix(ta, tb, min(len(ta), len(tb)))
            if n >= MIN_SHARED + max(held[a], held[b]):
                key = tuple(ta[:n])
                found[key] = min(found.get(key, a), a, b)
        if not found:
            return {}
        prefixes = sorted(found, key=len)
        sub = [(list(p), [q for q in encoded[found[p]][1] if q < len(p)]) for p in prefixes]
        sub_keys = [keys[found[p]][:len(pos)] for p, (_, pos) in zip(prefixes, sub)]
        nested = self._prime(model, sub, sub_keys, batch_size, pad_id)
        work, charged = [], {}
        for i, ((ids, pos), ks) in enumerate(zip(sub, sub_keys)):
            j0 = next((j for j, k in enumerate(ks) if k not in self.memo), len(pos))
            n, parts = self.kv.lookup(ids, max_len=pos[j0] if j0 < len(pos) else len(ids))
            row = found[prefixes[i]]
            charged[row] = charged.get(row, 0) + len(ids) - n + nested.get(i, 0)
            if n < len(ids):
                work.append((i, j0, n, parts, len(ids) - 1, ks))
        for start in range(0, len(work), batch_size):
            self._forward(model, sub, work[start:start + batch_size],
                          [[None] * len(pos) for _, pos in sub], pad_id)
        return charged

    def _forward(self, model: Any, encoded: Sequence[tuple[list[int], list[int]]], chunk: list,
                 out: list[list[float | None]], pad_id: int) -> None:
        import torch

        from omrl_search.kv_rows import kv_of_row, load_cached, make_cache, with_cache

        dev = model.head.weight.device
        backbone = model.backbone
        Wc = max(n for _, _, n, _, _, _ in chunk)
        Wn = max(last + 1 - n for _, _, n, _, last, _ in chunk)
        cache = make_cache(backbone.config, capacity=Wc + Wn)
        mask = load_cached(cache, [(n, parts) for _, _, n, parts, _, _ in chunk], Wc, dev) if Wc else None
        B = len(chunk)
        ids_t = torch.full((B, Wn), pad_id, dtype=torch.long)
        seg = torch.zeros((B, Wn), dtype=torch.long)
        for b, (r, _, n, _, last, _) in enumerate(chunk):
            new = encoded[r][0][n:last + 1]
            ids_t[b, :len(new)] = torch.tensor(new, dtype=torch.long)
            seg[b, :len(new)] = 1
        # absolute positions, as the uncached forward gives them (padding columns run on after)
        pos_t = torch.tensor([[n] for _, _, n, _, _, _ in chunk]) + torch.arange(Wn)[None]
        seg = seg.to(dev)
        mask = seg if mask is None else torch.cat([mask, seg], dim=1)
        hidden = backbone(input_ids=ids_t.to(dev), attention_mask=mask, position_ids=pos_t.to(dev),
                          **with_cache(backbone, cache)).last_hidden_state
        for b, (r, j0, n, _, last, keys) in enumerate(chunk):
            ids, pos = encoded[r]
            if pos[j0:]:  # (a shared prefix, forwarded for the KV alone, has no read)
                cols = torch.tensor([p - n for p in pos[j0:]], device=dev)
                vals = model.head(hidden[b, cols].to(model.head.weight.dtype)).squeeze(-1).float().tolist()
                for j, v in zip(range(j0, len(pos)), vals):
                    out[r][j] = v
                    self.memo[keys[j]] = v
            self.kv.insert(ids[:last + 1], kv_of_row(cache, mask, b, last + 1))
        while len(self.memo) > self.memo_entries:
            self.memo.popitem(last=False)
