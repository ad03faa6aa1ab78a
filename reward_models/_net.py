"""The torch module behind the learned reward models: an HF backbone and a scalar head.

Imported only when a model is built (``reward_models`` itself stays free of torch).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def decoder_layers(backbone: Any) -> nn.ModuleList:
    """The backbone's stack of transformer blocks (Llama/Qwen/Mistral ``layers``, GPT-2 ``h``)."""
    for attr in ("layers", "h", "blocks"):
        layers = getattr(backbone, attr, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the transformer layers of {type(backbone).__name__}")


def keep_bottom_layers(backbone: Any, n: int) -> None:
    """Cut the backbone to its first ``n`` blocks (a smaller, cheaper backbone); the config
    follows, so ``save_pretrained`` / ``from_pretrained`` round-trip the cut model."""
    layers = decoder_layers(backbone)
    if not 1 <= n <= len(layers):
        raise ValueError(f"keep_layers must be in 1..{len(layers)}, got {n}")
    for attr in ("layers", "h", "blocks"):
        if getattr(backbone, attr, None) is layers:
            setattr(backbone, attr, nn.ModuleList(list(layers)[:n]))
    cfg = backbone.config
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, key):
            setattr(cfg, key, n)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]


class ValueHeadModel(nn.Module):
    """``backbone`` (an HF base model returning ``last_hidden_state``) and a linear head that
    turns the hidden state at each read position into one logit."""

    def __init__(self, backbone: Any):
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        nn.init.normal_(self.head.weight, std=hidden ** -0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, max_steps]`` at ``positions`` (``[batch, max_steps]``, padded with 0)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.head(picked.to(self.head.weight.dtype)).squeeze(-1)

    def freeze(self, train_layers: int | None) -> int:
        """Train only the head, the final norm and the top ``train_layers`` blocks (``None``:
        everything). Returns the number of trainable parameters."""
        if train_layers is not None:
            layers = decoder_layers(self.backbone)
            if train_layers < 0 or train_layers > len(layers):
                raise ValueError(f"train_layers must be in 0..{len(layers)}, got {train_layers}")
            self.backbone.requires_grad_(False)
            for layer in list(layers)[len(layers) - train_layers:]:
                layer.requires_grad_(True)
            norm = getattr(self.backbone, "norm", None) or getattr(self.backbone, "ln_f", None)
            if norm is not None and train_layers > 0:
                norm.requires_grad_(True)
        self.head.requires_grad_(True)
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
