"""Pieces the policy trainers share: their settings, the model + data setup, the forward pass to
logprobs, and the config fields that name a registered loss variant."""
from __future__ import annotations

import contextlib
import copy
from typing import Annotated, Any, Callable, Iterator, Literal, Sequence

from pydantic import AfterValidator, Field

from .data import GrammarMasks, RowBuilder, collate
from .losses import ADVANTAGES, AGGREGATIONS, DPO_LOSSES
from .packing import add_layout, model_logprobs
from .runtime import TrainConfig, is_peft

#: config fields whose value must name an entry of a :mod:`train.losses` registry (checked when
#: the config is built, so a YAML typo fails at once with the known names)
AggregationName = Annotated[str, AfterValidator(AGGREGATIONS.check)]
DPOLossName = Annotated[str, AfterValidator(DPO_LOSSES.check)]
AdvantageName = Annotated[str, AfterValidator(ADVANTAGES.check)]


class PolicyConfig(TrainConfig):
    """Settings of the policy trainers (SFT, DPO, GRPO, PPO): how a micro-batch is laid out for
    the model (see :mod:`train.packing`; the losses are the same in every layout)."""

    layout: Literal["padded", "packed", "shared-prefix"] = "shared-prefix"
    pack_tokens: int = Field(2048, ge=8)  # tokens per packed row (packed layouts)


def make_builder(cfg: TrainConfig, model: Any, hf_tokenizer: Any) -> RowBuilder:
    """A RowBuilder for this model: its vocabulary, ``cfg.max_length``, and a TurnEncoder over
    its chat template for rows that only have messages."""
    from omrl_search.agent import TurnEncoder
    from omrl_search.backends.hf_tokenizer import HFChatTokenizer

    vocab = model.get_input_embeddings().weight.shape[0]
    return RowBuilder(TurnEncoder(HFChatTokenizer(hf_tokenizer)), vocab, cfg.max_length)


def grammar_masks(model: Any, hf_tokenizer: Any) -> GrammarMasks:
    """Rebuilds the masks of grammar-constrained samples for this model: its vocabulary and the
    stop tokens the ``hf`` backend allows where a grammar may end (the tokenizer's EOS, the
    generation config's and the chat format's end of turn), so the masks are the sampler's."""
    from omrl_search.backends.hf_tokenizer import HFChatTokenizer

    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    stops = HFChatTokenizer(hf_tokenizer, extra_eos_ids=[i for i in extra if i is not None]).eos_token_ids
    return GrammarMasks(hf_tokenizer, model.get_input_embeddings().weight.shape[0], stops)


def pad_id(hf_tokenizer: Any) -> int:
    return int(hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None
               else hf_tokenizer.eos_token_id)


def layout_collate(cfg: PolicyConfig, pid: int,
                   collate_fn: Callable[[Sequence[Any], int], dict[str, Any]] = collate,
                   masks: GrammarMasks | None = None) -> Callable[[Sequence[Any]], dict[str, Any]]:
    """``collate(examples)`` for the Runner: ``collate_fn`` (padded ``[B, T]`` tensors for the
    losses), then the model inputs of ``cfg.layout``; with ``masks``, the grammar masks of
    constrained samples (rows of ``collate``: one sequence per example)."""
    def fn(xs: Sequence[Any]) -> dict[str, Any]:
        batch = add_layout(collate_fn(xs, pid), cfg.layout, cfg.pack_tokens)
        if masks is not None:
            extra = masks(xs)
            stats = extra.pop("stats", None)
            batch.update(extra)
            if stats:
                batch["stats"] = {**batch.get("stats", {}), **stats}
        return batch
    return fn


def policy_logprobs(model: Any, batch: dict[str, Any]) -> Any:
    """``[B, T]`` float32 logprobs of the batch's ids, aligned with them: on loss tokens (and 0
    elsewhere) for a batch with a layout, on every token for a plain collated one."""
    return model_logprobs(model, batch)[0]


class Reference:
    """The frozen reference policy: the base with the adapter disabled under LoRA (no copy),
    else a frozen copy of the initial model (made on first use, kept on the model's device)."""

    def __init__(self, model: Any, path_model: Any = None):
        self._copy = path_model
        if self._copy is None and not is_peft(model):
            self._copy = copy.deepcopy(model).eval()
            for p in self._copy.parameters():
                p.requires_grad_(False)

    def release(self) -> None:
        """Free the frozen copy (once its log-probs are precomputed)."""
        self._copy = None

    @contextlib.contextmanager
    def active(self, model: Any) -> Iterator[Any]:
        import torch

        with torch.no_grad():
            if self._copy is not None:
                dev = next(model.parameters()).device
                yield self._copy.to(dev)
            else:
                with model.disable_adapter():
                    yield model

    def logprobs(self, model: Any, batch: dict[str, Any]) -> Any:
        with self.active(model) as ref:
            return policy_logprobs(ref, batch)
