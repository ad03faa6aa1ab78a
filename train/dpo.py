"""DPO on sibling pairs: loss on the continuation tokens only; ``loss:`` names the variant in
:data:`train.losses.DPO_LOSSES` (``sigmoid``, ``ipo``, ``hinge``, or one registered there).

The reference is the initial policy: with LoRA the base with the adapter disabled, otherwise a
frozen copy, or ``ref_model`` (another HF folder). ``reference: precomputed`` computes the
reference log-probabilities once before training (no second model in memory during training);
``reference: model`` runs the reference in every step.

**RPO** (``rpo_alpha``, Pang et al. 2024 "Iterative Reasoning Preference Optimization"): the
loss is ``dpo + rpo_alpha * nll(chosen)``, the chosen continuation's per-token negative
log-likelihood (:func:`train.losses.nll_loss`). DPO alone only widens the margin, and on
pairs from one policy it typically lowers the chosen side's likelihood too (both fall, the
rejected faster); the NLL term holds the chosen side up. Every step logs
``chosen_logp_change`` (the mean over the batch's pairs of the chosen sequence logprob minus
the reference's, as the loss reads it) and ``chosen_logp_change_per_token``, so a falling chosen
likelihood shows. With the defaults (``beta`` 0.1, ``lr`` 5e-6, ``rpo_alpha`` 1.0) it does not
fall on the tiny-model test (tests/test_trainers.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .common import (DPOLossName, PolicyConfig, Reference, layout_collate, make_builder, pad_id,
                     policy_logprobs)
from .data import PairRow, collate_pairs, load_dpo
from .losses import DPO_LOSSES, dpo_loss, nll_loss
from .runtime import ListSource, Runner, load_model


class DPOConfig(PolicyConfig):
    lr: float = Field(5e-6, gt=0)
    beta: float = Field(0.1, gt=0)
    rpo_alpha: float = Field(1.0, ge=0)  # weight of the chosen side's NLL (RPO); 0: plain DPO
    loss: DPOLossName = "sigmoid"  # a name in train.losses.DPO_LOSSES
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    reference: Literal["precomputed", "model"] = "precomputed"
    ref_model: str | None = None  # an HF folder; default: the initial policy


def mean_logps(cfg: DPOConfig) -> bool:
    """Whether the chosen variant takes per-token mean sequence logprobs (IPO) or sums."""
    return bool(getattr(DPO_LOSSES[cfg.loss], "mean_logps", False))


def seq_logps(lp: Any, mask: Any, mean: bool) -> Any:
    """Sum (or, for IPO, mean) of token logprobs over the loss mask, per sequence."""
    s = (lp * mask).sum(-1)
    return s / mask.sum(-1).clamp(min=1.0) if mean else s


def dpo_loss_fn(cfg: DPOConfig, reference: Reference | None):
    """``loss_fn(model, batch)``; the batch is ``collate_pairs`` (chosen rows, then rejected),
    with ``ref_logps`` ``[2B]`` attached when precomputed."""
    mean = mean_logps(cfg)

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        mask = batch["loss_mask"]
        lp = policy_logprobs(model, batch)
        logps = seq_logps(lp, mask, mean)
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
        else:
            ref = seq_logps(reference.logprobs(model, batch), mask, mean)
        c, r = logps.chunk(2)
        rc, rr = ref.chunk(2)
        losses, cr, rr_ = dpo_loss(c, r, rc, rr, beta=cfg.beta, kind=cfg.loss,
                                   label_smoothing=cfg.label_smoothing)
        loss = losses.mean()
        c_mask = mask.chunk(2)[0]
        nll = nll_loss(lp.chunk(2)[0], c_mask)
        if cfg.rpo_alpha:
            loss = loss + cfg.rpo_alpha * nll
        change = (c - rc).detach()
        per_token = change if mean else change / c_mask.sum(-1).clamp(min=1.0)
        return loss, {"tokens": float(batch["n_tokens"]),
                      "reward_chosen": float(cr.mean()), "reward_rejected": float(rr_.mean()),
                      "reward_acc": float((cr > rr_).float().mean()), "nll_chosen": float(nll.detach()),
                      "chosen_logp_change": float(change.mean()),
                      "chosen_logp_change_per_token": float(per_token.mean())}

    return loss_fn


def precompute_reference(runner: Runner, reference: Reference, pairs: list[PairRow],
                         collate: Any, mean: bool, batch_size: int) -> None:
    """Reference sequence logps of every pair (stored on the rows), with the initial weights."""
    model = runner.module
    was = model.training
    model.eval()
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        batch = runner.to_device(collate(chunk))
        with runner.autocast():
            ref = seq_logps(reference.logprobs(model, batch), batch["loss_mask"], mean).float().cpu()
        n = len(chunk)
        for j, p in enumerate(chunk):
            p.ref = (float(ref[j]), float(ref[n + j]))
    model.train(was)


def build(cfg: DPOConfig) -> Runner:
    model, tok = load_model(cfg)
    pairs = load_dpo(cfg.data, make_builder(cfg, model, tok))
    pid = pad_id(tok)
    ref_copy = None
    if cfg.ref_model:
        ref_copy, _ = load_model(cfg.model_copy(update={"model": cfg.ref_model, "lora": None}))
    reference = Reference(model, ref_copy)
    precomputed = cfg.reference == "precomputed"
    pairs_collate = layout_collate(cfg, pid, collate_pairs)

    def collate(xs: list[PairRow]) -> dict[str, Any]:
        import torch

        batch = pairs_collate(xs)
        if precomputed:
            batch["ref_logps"] = torch.tensor([p.ref[0] for p in xs] + [p.ref[1] for p in xs],
                                              dtype=torch.float32)
        return batch

    runner = Runner(cfg, model, dpo_loss_fn(cfg, None if precomputed else reference),
                    ListSource(pairs, cfg.batch_size, seed=cfg.seed), collate, tokenizer=tok, kind="dpo")
    if precomputed:
        precompute_reference(runner, reference, pairs, pairs_collate, mean_logps(cfg), cfg.batch_size)
        reference.release()
    return runner


def train(cfg: DPOConfig) -> dict[str, Any]:
    return build(cfg).train()
