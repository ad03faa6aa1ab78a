"""The policy trainers by name: what ``omrl train KIND`` and the loop's policy stage run.

Importing this module imports torch (every trainer's losses do), so :mod:`train.cli` and
:mod:`train.loop` import it only when a trainer is about to run: ``omrl --help`` imports every
command module, and should not wait seconds for torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import dpo, grpo, ppo, sft
from .runtime import TrainConfig


@dataclass(frozen=True)
class Trainer:
    """A trainer's settings model and its ``train(config) -> last step's metrics``."""

    config: type[TrainConfig]
    train: Callable[[Any], dict[str, Any]]


TRAINERS: dict[str, Trainer] = {
    "sft": Trainer(sft.SFTConfig, sft.train),
    "dpo": Trainer(dpo.DPOConfig, dpo.train),
    "grpo": Trainer(grpo.GRPOConfig, grpo.train),
    "ppo": Trainer(ppo.PPOConfig, ppo.train),
}
