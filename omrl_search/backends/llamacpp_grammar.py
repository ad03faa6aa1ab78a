"""Grammar masks for the ``llamacpp`` backend (see :mod:`omrl_search.constrain`).

Two engines mask the batch's numpy logits before the backend's own sampler:

* ``gbnf``: llama.cpp's grammar sampler (``llama_sampler_init_grammar``, what
  ``llama_cpp.LlamaGrammar`` holds the text for), parsed once per grammar text and cloned per
  row; each step it walks every vocabulary entry through the grammar, which measured 20-60 ms
  per row and step for SmolLM2's 49k vocabulary on the development VM. It matches control
  tokens by their text (``<|im_start|>`` would pass a free-text rule), so they are masked
  after it;
* ``xgrammar``: the same token bitmask as the ``hf`` backend, over the GGUF's vocabulary (each
  token's raw bytes; control tokens never allowed), microseconds per row and step after a
  compile per grammar text.

Both get :attr:`Grammar.text <omrl_search.constrain.Grammar.text>` and accept the same
language (tests/test_constrain.py compares their masks; seeded samples are token for token the
same). Measured with ``benchmarks/constrained_decoding.py`` (SmolLM2, Game24 first steps, batch
8, one thread, the 2-core development VM under load): the mask took 38% of the decode loop's
CPU time with ``gbnf`` (decode 62 -> 38 tokens per CPU-second) and 1.1-1.6% with ``xgrammar``,
whose first grammar costs ~1.5 s once (the vocabulary's token table) and ~15 ms per new text.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

from ..constrain import Grammar, GrammarError, TokenMasker, LRU


def raw_pieces(ll: Any, vocab: Any, n_vocab: int) -> list[bytes]:
    """Each token's bytes as it appears in text (empty for control tokens such as
    ``<|im_end|>``, which ``token_to_piece`` renders only with ``special=True``)."""
    out = []
    buf = ctypes.create_string_buffer(256)
    for t in range(n_vocab):
        n = ll.llama_token_to_piece(vocab, t, buf, 256, 0, False)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(vocab, t, big, -n, 0, False)
            out.append(big.raw[:n])
        else:
            out.append(buf.raw[:n])
    return out


class XGrammarEngine:
    """:class:`~omrl_search.constrain.TokenMasker` over the GGUF vocabulary, on numpy logits."""

    def __init__(self, ll: Any, vocab: Any, n_vocab: int, eos_ids: Sequence[int]) -> None:
        import torch

        self._torch = torch
        self.masker = TokenMasker.from_pieces(raw_pieces(ll, vocab, n_vocab), eos_ids, n_vocab)

    def guide(self, grammar: Grammar) -> Any:
        return self.masker.matcher(grammar)

    def mask(self, logits: Any, guides: list[Any]) -> Any:
        self.masker.mask(self._torch.from_numpy(logits), guides)  # in place, shared memory
        return logits

    def close(self) -> None:
        pass


class GBNFEngine:
    """llama.cpp's GBNF grammar sampler: one parsed sampler per grammar text (an LRU of
    ``cache_size``), cloned for each row, applied row by row to numpy logits."""

    def __init__(self, ll: Any, vocab: Any, n_vocab: int, eos_ids: Sequence[int], np: Any,
                 cache_size: int = 64) -> None:
        self._ll, self._vocab, self._np = ll, vocab, np
        self.n_vocab = n_vocab
        self._stops = np.asarray(sorted(eos_ids), dtype=np.int64)
        self._templates = LRU(cache_size)
        dt = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
        if dt.itemsize != ctypes.sizeof(ll.llama_token_data):
            raise GrammarError("llamacpp: unexpected llama_token_data layout; use grammar_engine=xgrammar")
        # llama.cpp matches a control token (``<|im_start|>``...) by its text, so a free-text
        # rule would allow it; like xgrammar here, never allow one (EOS is the grammar's business)
        control = ll.LLAMA_TOKEN_ATTR_CONTROL
        self._control = np.asarray([t for t in range(n_vocab) if ll.llama_vocab_get_attr(vocab, t) & control
                                    and t not in set(eos_ids)], dtype=np.int64)
        self._buf = np.zeros(n_vocab, dtype=dt)
        self._buf["id"] = np.arange(n_vocab, dtype=np.int32)
        self._arr = ll.llama_token_data_array()

    def _template(self, grammar: Grammar) -> Any:
        smpl = self._templates.get(grammar.text)
        if smpl is None:
            smpl = self._ll.llama_sampler_init_grammar(self._vocab, grammar.text.encode("utf-8"), b"root")
            if not smpl:
                raise GrammarError(f"{grammar.label()} does not compile (llama.cpp's GBNF parser "
                                   "refused it; its message is on stderr)")
            while len(self._templates) >= self._templates.size:
                _, old = self._templates.popitem(last=False)
                self._ll.llama_sampler_free(old)
            self._templates.put(grammar.text, smpl)
        return smpl

    def guide(self, grammar: Grammar) -> "GBNFGuide":
        return GBNFGuide(self._ll, self._ll.llama_sampler_clone(self._template(grammar)))

    def mask(self, logits: Any, guides: list[Any]) -> Any:
        ll, buf, arr, np = self._ll, self._buf, self._arr, self._np
        for j, g in enumerate(guides):
            if g is None:
                continue
            buf["logit"] = logits[j]
            arr.data = buf.ctypes.data_as(ll.llama_token_data_p)
            arr.size, arr.selected, arr.sorted = self.n_vocab, -1, False
            ll.llama_sampler_apply(g.smpl, ctypes.byref(arr))
            if arr.size != self.n_vocab:  # the grammar sampler masks in place; it never should resize
                raise GrammarError("llamacpp: the GBNF sampler resized the candidates")
            logits[j] = buf["logit"]
            logits[j, self._control] = -np.inf
            if not np.isfinite(logits[j]).any():  # nothing allowed: let the row end
                logits[j, self._stops] = 0.0
        return logits

    def close(self) -> None:
        while self._templates:
            _, smpl = self._templates.popitem()
            self._ll.llama_sampler_free(smpl)


class GBNFGuide:
    """One row's clone of a GBNF grammar sampler."""

    __slots__ = ("_ll", "smpl", "_one", "_arr")

    def __init__(self, ll: Any, smpl: Any) -> None:
        self._ll, self.smpl = ll, smpl
        self._one = ll.llama_token_data(0, 0.0, 0.0)
        self._arr = ll.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)

    def accept(self, token: int) -> None:
        """Advance past ``token``. llama.cpp aborts the process when its grammar accepts a
        token it does not allow, so the token is checked first (a one-candidate apply)."""
        ll, one, arr = self._ll, self._one, self._arr
        one.id, one.logit, arr.size, arr.selected = int(token), 0.0, 1, -1
        ll.llama_sampler_apply(self.smpl, ctypes.byref(arr))
        if one.logit == float("-inf"):
            raise GrammarError(f"llamacpp: token {token} is not allowed by the grammar here")
        ll.llama_sampler_accept(self.smpl, int(token))

    def close(self) -> None:
        if self.smpl is not None:
            self._ll.llama_sampler_free(self.smpl)
            self.smpl = None
