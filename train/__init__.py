"""Trainers over exported search trees: SFT, DPO, GRPO (offline, online, iterative), PPO, PRM.

``losses`` (pure tensor functions), ``data`` (parquet loading, masks from segments, packing),
``runtime`` (the shared engine: device, bf16, accumulation, LoRA, DeepSpeed, checkpoints, exact
resume, logs), one short module per trainer, and ``cli`` (``omrl train``). The core
(``omrl_search``) never imports this package, so search stays light to install.
"""
