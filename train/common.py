"""Pieces the policy trainers share: the model + data setup, the forward pass to logprobs, and
the config fields that name a registered loss variant."""
from __future__ import annotations

import contextlib
import copy
from typing import Annotated, Any, Iterator

from pydantic import AfterValidator

from .data import RowBuilder
from .losses import ADVANTAGES, AGGREGATIONS, DPO_LOSSES, sequence_logprobs
from .runtime import TrainConfig, is_peft

#: config fields whose value must name an entry of a :mod:`train.losses` registry (checked when
#: the config is built, so a YAML typo fails at once with the known names)
AggregationName = Annotated[str, AfterValidator(AGGREGATIONS.check)]
DPOLossName = Annotated[str, AfterValidator(DPO_LOSSES.check)]
AdvantageName = Annotated[str, AfterValidator(ADVANTAGES.check)]


def make_builder(cfg: TrainConfig, model: Any, hf_tokenizer: Any) -> RowBuilder:
    """A RowBuilder for this model: its vocabulary, ``cfg.max_length``, and a TurnEncoder over
    its chat template for rows that only have messages."""
    from omrl_search.agent import TurnEncoder
    from omrl_search.backends.hf_tokenizer import HFChatTokenizer

    vocab = model.get_input_embeddings().weight.shape[0]
    return RowBuilder(TurnEncoder(HFChatTokenizer(hf_tokenizer)), vocab, cfg.max_length)


def pad_id(hf_tokenizer: Any) -> int:
    return int(hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None
               else hf_tokenizer.eos_token_id)


def forward(model: Any, batch: dict[str, Any], **kwargs: Any) -> Any:
    """The model on a collated batch (padded with an attention mask, or packed with position
    ids and no mask)."""
    kw: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, **kwargs}
    if "position_ids" in batch:
        kw["position_ids"] = batch["position_ids"]
    else:
        kw["attention_mask"] = batch["attention_mask"]
    return model(**kw)


def policy_logprobs(model: Any, batch: dict[str, Any]) -> Any:
    """``[B, T]`` logprobs of the batch's ids, aligned with them (float32)."""
    return sequence_logprobs(forward(model, batch).logits, batch["input_ids"])


class Reference:
    """The frozen reference policy: the base with the adapter disabled under LoRA (no copy),
    else a frozen copy of the initial model (made on first use, kept on the model's device)."""

    def __init__(self, model: Any, path_model: Any = None):
        self._copy = path_model
        if self._copy is None and not is_peft(model):
            self._copy = copy.deepcopy(model).eval()
            for p in self._copy.parameters():
                p.requires_grad_(False)

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
