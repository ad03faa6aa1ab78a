"""SFT: masked NLL on the trainable (assistant) tokens of exported trajectories, optionally packed."""
from __future__ import annotations

from typing import Any

from .common import AggregationName, PolicyConfig, layout_collate, make_builder, pad_id, policy_logprobs
from .data import collate, collate_packed, load_sft, pack
from .losses import nll_loss
from .runtime import ListSource, Runner, TrainError, load_model


class SFTConfig(PolicyConfig):
    packing: bool = False  # batch_size rows each packed with sequences up to max_length (no cross-attention)
    agg: AggregationName = "token-mean"  # a name in train.losses.AGGREGATIONS

def sft_loss(agg: str = "token-mean"):
    """``loss_fn(model, batch)`` for the Runner."""

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        lp = policy_logprobs(model, batch)
        loss = nll_loss(lp, batch["loss_mask"], agg)
        return loss, {"tokens": float(batch["n_tokens"]), "loss_tokens": float(batch["loss_mask"].sum())}

    return loss_fn


def build(cfg: SFTConfig) -> Runner:
    model, tok = load_model(cfg)
    rows = load_sft(cfg.data, make_builder(cfg, model, tok))
    pid = pad_id(tok)
    items: list[Any] = pack(rows, cfg.max_length) if cfg.packing else rows
    fn = layout_collate(cfg, pid, collate_packed if cfg.packing else collate)
    if len(items) < cfg.batch_size:
        raise TrainError(f"{len(items)} training rows cannot fill a batch of {cfg.batch_size}")
    source = ListSource(items, cfg.batch_size, seed=cfg.seed)
    return Runner(cfg, model, sft_loss(cfg.agg), source, fn, tokenizer=tok, kind="sft")


def train(cfg: SFTConfig) -> dict[str, Any]:
    return build(cfg).train()
