"""A :class:`~omrl_search.policy.ChatTokenizer` over a Hugging Face tokenizer, and the small pieces
of chat-template handling the ``hf`` and ``llamacpp`` backends share.

Imports nothing heavy at module level: ``transformers`` objects are passed in, ``jinja2`` is imported
when a template is first compiled.
"""
from __future__ import annotations

from typing import Any, Sequence

#: special tokens that end an assistant turn in common chat formats; whichever of them the
#: vocabulary has as a single token count as EOS (besides the tokenizer's own EOS).
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (SmolLM2, Qwen)
    "<|eot_id|>",  # Llama 3
    "<|end|>",  # Phi 3
    "<end_of_turn>",  # Gemma
    "<|end_of_turn|>",
    "<|endoftext|>",
)

#: used when a model ships no chat template (a base model): plain ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def compile_chat_template(source: str) -> Any:
    """Compile a chat template the way transformers does (sandboxed jinja2, trim_blocks,
    lstrip_blocks, ``raise_exception`` and ``strftime_now`` available)."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        import json

        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class HFChatTokenizer:
    """Wraps a ``transformers`` tokenizer as a ChatTokenizer.

    ``encode`` adds no BOS/EOS (special-token *text* in the input, e.g. ``<|im_start|>``, is still
    parsed as the special token, so ``encode(render(messages))`` gives the ids the model expects);
    ``decode`` keeps special tokens; ``render`` applies the model's chat template (plain ChatML if it
    has none). ``eos_token_ids`` holds the tokenizer's EOS, the generation config's EOS ids and the
    end-of-turn marker of the chat format.
    """

    def __init__(self, tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = tokenizer
        ids: set[int] = set(int(i) for i in extra_eos_ids if i is not None)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        for tok in END_OF_TURN_TOKENS:
            if tok in vocab and tok in set(tokenizer.all_special_tokens) | set(
                str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            ):
                ids.add(int(vocab[tok]))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._template = None
        if not getattr(tokenizer, "chat_template", None):
            self._template = compile_chat_template(CHATML_TEMPLATE)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf.pad_token_id
        if pad is None:
            pad = self.hf.eos_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        return int(pad)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self._template is not None:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        out = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return out if isinstance(out, str) else out[0]

    def __len__(self) -> int:
        return len(self.hf)
