"""What the in-process backends (``hf``, ``llamacpp``) share: requests cut into chunks of rows,
each chunk prefilled and then decoded one token per step for all its rows together.

:class:`ChunkedDecoder` holds the loop; a backend supplies the model-specific parts (prefill a
chunk, sample a batch of logits, feed the sampled tokens back) as the methods listed there.
:class:`Row` is one sequence's bookkeeping; :func:`prefix_groups` finds the prompt prefixes a
chunk shares, which both backends compute once (with
:func:`omrl_search.prefix_cache.common_prefix`, what their prefix caches match prompts with).
"""
from __future__ import annotations

import contextlib
import functools
import random
from typing import Any, Sequence

from ..prefix_cache import common_prefix
from ..constrain import Grammar, GrammarError, stamp
from ..types import GenRequest, Generation


class Row:
    """One generated sequence's bookkeeping, shared by the backends: its tokens and raw logprobs,
    when it ends (EOS: kept in ``token_ids``, cut from the text; a stop string: text cut
    before it, ``token_ids`` up to the token that completed it; ``limit`` tokens: "length"), and
    its own random stream ``rng``, seeded from ``seed`` (its request's seed and sample index)."""

    __slots__ = ("prompt_len", "limit", "tok", "eos", "stops", "max_stop", "ids", "lps", "checked",
                 "result", "rng", "params", "cached")

    def __init__(self, prompt: Sequence[int], params: Any, limit: int, tokenizer: Any,
                 seed: str = "") -> None:
        self.rng = random.Random(seed)
        self.params = params
        self.prompt_len = len(prompt)
        self.limit = limit
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_ids
        self.stops = tuple(s for s in params.stop if s)
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.checked = 0  # length of the decoded text already searched for stop strings
        self.result: Generation | None = None
        self.cached = 0  # prompt tokens a prefix cache served (Generation.cached_tokens)

    def push(self, token: int, logprob: float) -> bool:
        """Append one sampled token; return True (and set ``result``) when the sequence ends."""
        ids = self.ids
        ids.append(token)
        self.lps.append(logprob)
        if token in self.eos:
            return self._end(self.tok.decode(ids[:-1]), "stop", True)
        if self.stops:
            text = self.tok.decode(ids)
            lo = max(0, self.checked - self.max_stop + 1)
            hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
            self.checked = len(text)
            if hits:
                return self._end(text[:min(hits)], "stop", False)
        if len(ids) >= self.limit:
            return self._end(None, "length", False)
        return False

    def _end(self, text: str | None, reason: str, eos: bool) -> bool:
        self.result = Generation(
            text=self.tok.decode(self.ids) if text is None else text,
            token_ids=self.ids,
            logprobs=self.lps,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.ids),
            finish_reason=reason,
            ended_with_eos=eos,
            cached_tokens=self.cached,
        )
        return True


class ChunkedDecoder:
    """:meth:`generate` for a backend that decodes rows in chunks of at most ``max_batch``.

    Every request becomes ``params.n`` rows (a request for no tokens is answered at once); rows
    are ordered by :meth:`_order_key` of their prompt, so prompts that share prefixes or have
    similar lengths land in the same chunk. For each chunk, :meth:`prefill_chunk` evaluates the
    prompts and gives the first logits; then, until every row has ended, :meth:`_sample_rows`
    picks a token per batch row and :meth:`_step` feeds the still-running rows' tokens back.

    A backend provides ``tokenizer``, ``max_batch``, ``prompt_ids_of(request)`` and the methods
    below that raise ``NotImplementedError``.
    """

    tokenizer: Any
    max_batch: int

    # --- what a backend provides ------------------------------------------------------------
    def _check_open(self) -> None:
        """Raise a PolicyError when the model was closed."""
        raise NotImplementedError

    def _new_seed(self) -> int:
        """A seed for a request that gives none (from the backend's own generator)."""
        raise NotImplementedError

    def _context_len(self) -> int:
        """The most tokens (prompt + completion) one sequence may hold."""
        raise NotImplementedError

    def _order_key(self, prompt: list[int]) -> Any:
        """Rows are sorted by this key of their prompt before they are cut into chunks."""
        raise NotImplementedError

    def _decoding(self) -> Any:
        """A context manager around all the chunks of one call."""
        return contextlib.nullcontext()

    def prefill_chunk(self, chunk: list[tuple[int, int]], prompts: list[list[int]],
                 rows: list[Row]) -> tuple[Any, Any]:
        """Evaluate the chunk's prompts; return the backend's decoding state and the logits of
        the next token, one row per chunk row (``chunk[j]`` = (request index, sample index))."""
        raise NotImplementedError

    def _sample_rows(self, state: Any, logits: Any, rows: list[Row]) -> tuple[list[int], list[float]]:
        """A token per batch row (``rows[j]`` is batch row ``j``) and its logprob."""
        raise NotImplementedError

    def _step(self, state: Any, tokens: list[int], active: list[int],
              keep: list[int]) -> tuple[list[int], Any]:
        """Feed the sampled ``tokens`` (one per batch row; ``active[j]``: the chunk row of batch
        row ``j``) to the model. Rows ``keep`` are still running; the others have ended and may
        be dropped from the batch. Return the batch rows kept (a superset of ``keep``, in
        order) and their next logits."""
        raise NotImplementedError

    def _end_chunk(self, state: Any, active: list[int]) -> None:
        """Called once every row of a chunk has ended (``active[j]``: the chunk row still in
        batch row ``j``), before the state is dropped: a backend with a prefix cache stores
        the rows' sequences here."""

    # --- structured decoding (optional; see omrl_search.constrain) ---------------------------
    #: the backend masks logits with a grammar (``GenRequest.grammar``)
    supports_grammar = True

    def guide_for(self, grammar: Grammar) -> Any:
        """A fresh per-row grammar state (``accept(token)``, ``close()``); compiles ``grammar``
        (once per text) and raises a one-line GrammarError naming it when it does not."""
        raise NotImplementedError

    def mask_logits(self, state: Any, logits: Any, guides: list[Any]) -> Any:
        """``logits`` with the tokens ``guides[j]`` does not allow next set to ``-inf`` in
        batch row ``j`` (None: no grammar, or the row has ended)."""
        raise NotImplementedError

    # --- the shared loop --------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        self._check_open()
        out: list[list[Generation | None]] = [[None] * r.params.n for r in requests]
        if not requests:
            return []
        prompts = [self.prompt_ids_of(r) for r in requests]  # type: ignore[attr-defined]
        seeds = [self._new_seed() if r.params.seed is None else r.params.seed for r in requests]
        rows: list[tuple[int, int]] = []
        for ri in sorted(range(len(requests)), key=lambda i: self._order_key(prompts[i])):
            p = requests[ri].params
            for si in range(p.n):
                if p.max_tokens <= 0:
                    out[ri][si] = stamp(Generation("", [], [], len(prompts[ri]), 0, "length", False),
                                        requests[ri].grammar, "partial")
                else:
                    rows.append((ri, si))
        with self._decoding():
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start:start + self.max_batch]
                for (ri, si), g in zip(chunk, self._run_chunk(chunk, requests, prompts, seeds)):
                    out[ri][si] = g
        return out  # type: ignore[return-value]

    def _run_chunk(self, chunk: list[tuple[int, int]], requests: list[GenRequest],
                   prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        context = self._context_len()
        rows = []
        for ri, si in chunk:
            p = requests[ri].params
            rows.append(Row(prompts[ri], p, min(p.max_tokens, context - len(prompts[ri])),
                            self.tokenizer, f"{seeds[ri]}:{si}"))
        grammars = [requests[ri].grammar for ri, _ in chunk]
        guides: list[Any] = []
        try:
            # a grammar that does not compile fails here, before any model work
            try:
                guides.extend(self.guide_for(g) if g is not None else None for g in grammars)
            except GrammarError as exc:
                raise GrammarError(f"{getattr(self, 'name', 'policy')}: {exc}") from None
            guided = any(g is not None for g in guides)
            state, logits = self.prefill_chunk(chunk, prompts, rows)
            active = list(range(len(chunk)))  # chunk row of each batch row
            n_live = len(chunk)
            while True:
                if guided:
                    logits = self.mask_logits(state, logits, [guides[b] if rows[b].result is None else None
                                                        for b in active])
                tokens, lps = self._sample_rows(state, logits, [rows[b] for b in active])
                for j, b in enumerate(active):
                    row = rows[b]
                    if row.result is None:
                        if row.push(tokens[j], lps[j]):
                            n_live -= 1
                        elif guides[b] is not None:
                            guides[b].accept(tokens[j])
                if n_live == 0:
                    break
                keep = [j for j, b in enumerate(active) if rows[b].result is None]
                kept, logits = self._step(state, tokens, active, keep)
                active = [active[j] for j in kept]
            self._end_chunk(state, active)
        finally:
            for g in guides:
                if g is not None:
                    g.close()
        for row, grammar in zip(rows, grammars):
            if grammar is not None:
                stamp(row.result, grammar, None if _can_check() else
                      ("ok" if row.result.ended_with_eos else "partial"))
        return [r.result for r in rows]  # type: ignore[misc]


@functools.lru_cache(maxsize=1)
def _can_check() -> bool:
    """Whether the client-side checker (xgrammar) is installed; without it a row generated
    under the backend's own grammar engine is "ok" when the grammar let it end (EOS is only
    allowed where the grammar is complete), else "partial"."""
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


def _shared_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest prefix all ``prompts`` share, leaving each at least one token."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = common_prefix(p, first, n)
    return max(n, 0)


def prefix_groups(prompts: list[list[int]], min_shared: int) -> tuple[int, list[tuple[list[int], int]]]:
    """Shared prefixes of distinct ``prompts``: ``base``, the prefix all share (0 when shorter
    than ``min_shared``), and groups of prompt indices (neighbours in sorted order sharing at
    least ``min_shared`` tokens more: one task's prompt and path), each with the prefix its
    members share (``base`` for a group of one). Every prefix leaves each prompt a token."""
    base = _shared_prefix(prompts) if len(prompts) > 1 else 0
    base = base if base >= min_shared else 0
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    groups: list[tuple[list[int], int]] = [(order[:1], base)]
    for a, b in zip(order, order[1:]):
        n = _shared_prefix([prompts[a], prompts[b]])
        members, shared = groups[-1]
        if n >= base + min_shared:
            members.append(b)
            groups[-1] = (members, n if len(members) == 2 else min(shared, n))
        else:
            groups.append(([b], base))
    return base, groups
