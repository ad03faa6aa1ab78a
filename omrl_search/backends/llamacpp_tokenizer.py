"""llama.cpp's tokenizer for a loaded model, as the engine's ChatTokenizer (the chat template
is the GGUF's own, else ChatML, rendered by the same Jinja code as the ``hf`` backend's)."""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

from ..policy import PolicyError
from .hf_tokenizer import CHATML_TEMPLATE, compile_chat_template


class LlamaCppTokenizer:
    """llama.cpp's tokenizer for a loaded model, as a ChatTokenizer."""

    @property
    def vocab(self) -> Any:
        """llama.cpp's vocabulary handle (what its grammar samplers are made for)."""
        return self._vocab

    def __init__(self, ll: Any, model: Any) -> None:
        self._ll = ll
        self._vocab = ll.llama_model_get_vocab(model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self.eos_token_ids = frozenset(
            i for i in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, i)
        )
        self._pieces: dict[int, bytes] = {}
        raw = ll.llama_model_chat_template(model, None)
        self.chat_template = raw.decode("utf-8") if raw else CHATML_TEMPLATE
        self._template = compile_chat_template(self.chat_template)
        bos, eos = ll.llama_vocab_bos(self._vocab), ll.llama_vocab_eos(self._vocab)
        self._bos_text = self.decode([bos]) if 0 <= bos < self.n_vocab else ""
        self._eos_text = self.decode([eos]) if 0 <= eos < self.n_vocab else ""

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        for _ in range(2):
            buf = (self._ll.llama_token * size)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, size, False, True)
            if n >= 0:
                return list(buf[:n])
            size = -n
        raise PolicyError("llamacpp: tokenization failed")

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._ll.llama_token_to_piece(self._vocab, token, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, True)
            piece = self._pieces[token] = buf.raw[:max(n, 0)]
        return piece

    def decode(self, ids: Sequence[int]) -> str:
        piece = self._piece
        return b"".join([piece(int(t)) for t in ids]).decode("utf-8", errors="replace")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_text,
            eos_token=self._eos_text,
        )
