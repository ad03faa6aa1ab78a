"""PPO: the GRPO machinery (offline groups or online rounds) with a learned value head and GAE.

``advantage:`` names the estimator in :data:`train.losses.ADVANTAGES`. With one that needs
values (``gae``, the default) a linear head on the policy's last hidden state predicts, at each
token, the return from there on; the trajectory's reward sits on its last trainable token, and
GAE runs over the policy's own tokens only (observation and prompt tokens are skipped, neither
discounting nor bootstrapping). Advantages are whitened over the batch's loss tokens. The value
targets come from the head's values at the update (``old_values`` = the same values, detached),
so the value clip only acts within one batch. A group estimator (``grpo``, ``dr-grpo``,
``rloo``) needs no head: GRPO under PPO's name. The head is saved next to the policy as
``value_head.safetensors``; the policy folder itself is an ordinary HF model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from .common import AdvantageName, Reference, grammar_masks, pad_id
from .grpo import GRPOConfig, grpo_loss_fn, make_source, needs_values, policy_loss, with_stats
from .losses import ADVANTAGES, value_loss
from .packing import model_logprobs
from .runtime import Runner, is_peft, load_model, load_weights

HEAD_FILE = "value_head.safetensors"


class PPOConfig(GRPOConfig):
    advantage: AdvantageName = "gae"  # a name in train.losses.ADVANTAGES; gae trains a value head
    value_estimators: ClassVar[bool] = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    vf_coef: float = Field(0.1, ge=0)
    value_clip: float | None = 0.2
    whiten: bool = True


def value_model(lm: Any) -> Any:
    """``lm`` with a zero-initialised value head (``.lm``, ``.v_head``)."""
    import torch

    class ValueModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm
            self.v_head = torch.nn.Linear(lm.config.hidden_size, 1)
            torch.nn.init.zeros_(self.v_head.weight)
            torch.nn.init.zeros_(self.v_head.bias)

        def forward(self, **kw: Any) -> Any:
            return self.lm(**kw)

        def disable_adapter(self) -> Any:
            return self.lm.disable_adapter()

    return ValueModel()


def save_value_model(model: Any, folder: str, merge: bool) -> None:
    from safetensors.torch import save_file

    lm = model.lm
    if merge and is_peft(lm):
        import copy

        lm = copy.deepcopy(lm).merge_and_unload()
    lm.save_pretrained(folder, safe_serialization=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.v_head.state_dict().items()},
              str(Path(folder) / HEAD_FILE))


def load_value_model(model: Any, folder: str) -> None:
    from safetensors.torch import load_file

    load_weights(model.lm, folder)
    model.v_head.load_state_dict(load_file(str(Path(folder) / HEAD_FILE)))


def ppo_loss_fn(cfg: PPOConfig, reference: Reference | None):
    """Clipped policy loss with the value-based estimator's advantages (GAE) plus ``vf_coef`` x
    the clipped value loss."""
    import torch

    estimate = ADVANTAGES[cfg.advantage]

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        mask = batch["loss_mask"]
        lp, hidden = model_logprobs(model.lm, batch, hidden=True)
        # values[t]: the value of the state before token t (aligned like the logprobs; loss tokens)
        values = model.v_head(hidden.float()).squeeze(-1) * mask
        last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
        rewards = torch.zeros_like(values)
        rewards[torch.arange(len(last), device=mask.device), last] = batch["rewards"]
        with torch.no_grad():
            adv, ret = estimate(rewards, values.detach(), mask, gamma=cfg.gamma, lam=cfg.lam)
            if cfg.whiten:
                n = mask.sum().clamp(min=1)
                mean = (adv * mask).sum() / n
                std = (((adv - mean) * mask) ** 2).sum().div(n).sqrt()
                adv = (adv - mean) / (std + 1e-6) * mask
        pg, metrics = policy_loss(cfg, reference, model, batch, adv, lp=lp)
        vl = value_loss(values, values.detach(), ret, mask, clip=cfg.value_clip)
        metrics.update(value_loss=float(vl.detach()), policy_loss=float(pg.detach()))
        return pg + cfg.vf_coef * vl, metrics

    return loss_fn


def build(cfg: PPOConfig) -> Runner:
    lm, tok = load_model(cfg)
    source, total = make_source(cfg, lm, tok)
    reference = Reference(lm) if cfg.kl_coef else None
    collate = with_stats(source, cfg, pad_id(tok), grammar_masks(lm, tok))
    if not needs_values(cfg.advantage):
        return Runner(cfg, lm, grpo_loss_fn(cfg, reference), source, collate,
                      tokenizer=tok, kind="ppo", total_steps=total)
    model = value_model(lm)
    merge = cfg.lora is None or cfg.lora.merge
    runner: Runner | None = None

    def save(m: Any, folder: str) -> None:
        save_value_model(m, folder, merge=bool(runner and runner.saving_final and merge))

    runner = Runner(cfg, model, ppo_loss_fn(cfg, reference), source, collate,
                    tokenizer=tok, kind="ppo", total_steps=total, save_fn=save, load_fn=load_value_model)
    return runner


def train(cfg: PPOConfig) -> dict[str, Any]:
    return build(cfg).train()
