"""DeepSpeed ZeRO-2/3 under the Runner: engine setup, checkpoints, the final model.

Launch several processes with the usual launcher, e.g. on two CPU processes over gloo::

    torchrun --nproc_per_node 2 -m omrl_search.cli train sft --data sft.parquet \
        --set deepspeed.stage=3

(``deepspeed --num_gpus N -m omrl_search.cli train ...`` on GPUs: nccl). The Runner's own AdamW
and LR schedule are handed to DeepSpeed, which shards their state (stage 2: optimizer state and
gradients; stage 3: also the parameters) and does gradient accumulation; each process reads
its own slice of every global batch (:class:`~train.runtime.ListSource` splits by rank).
Checkpoints are DeepSpeed's (every rank writes its shard) plus one ``trainer_state`` file per rank
(RNG states, data position), renamed into place by rank 0 after a barrier; the final model is
gathered and written by rank 0 as an ordinary HF folder.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from .checkpoint_files import STATE_FILE, publish_folder
from .config import TrainError

DS_TAG = "ds"


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def deepspeed_engine(runner: Any) -> Any:
    """Initialise torch.distributed (gloo on CPU, nccl on GPUs unless set) and wrap the
    Runner's model, optimizer and scheduler in a DeepSpeed engine."""
    try:
        import deepspeed
    except ImportError:
        raise TrainError("deepspeed settings need the deepspeed package: pip install deepspeed") from None
    cfg, ds = runner.cfg, runner.cfg.deepspeed
    backend = ds.backend if ds.backend != "auto" else ("nccl" if runner.device.type == "cuda" else "gloo")
    if not _dist().is_initialized():
        deepspeed.init_distributed(dist_backend=backend)
    zero: dict[str, Any] = {"stage": ds.stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": runner.autocast_dtype is not None},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **ds.extra,
    }
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=runner.model, optimizer=runner.optimizer, lr_scheduler=runner.scheduler, config=config)
    runner.optimizer, runner.scheduler = optimizer, scheduler
    return engine


def _gathered(runner: Any) -> Any:
    """All parameters gathered on every rank (ZeRO-3), or nothing to do (ZeRO-2)."""
    if runner.cfg.deepspeed.stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(runner.module.parameters()), modifier_rank=None)


def save_deepspeed_checkpoint(runner: Any, final: Path) -> None:
    import torch


    dist = _dist()
    tmp = final.with_name(".tmp-" + final.name)
    if runner.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    runner.engine.save_checkpoint(str(tmp), tag=DS_TAG)
    torch.save(runner.trainer_state(), tmp / f"trainer_state_rank{runner.rank}.pt")
    dist.barrier()
    if runner.rank == 0:
        torch.save({"world": runner.world, "step": runner.step}, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        runner.prune_checkpoints()
    dist.barrier()


def load_deepspeed_checkpoint(runner: Any, ckpt: Path) -> dict[str, Any]:
    import torch


    meta = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    if meta.get("world") != runner.world:
        raise TrainError(f"{ckpt}: written by {meta.get('world')} processes, resuming with {runner.world}")
    path, _ = runner.engine.load_checkpoint(str(ckpt), tag=DS_TAG)
    if path is None:
        raise TrainError(f"{ckpt}: DeepSpeed could not load the checkpoint")
    return torch.load(ckpt / f"trainer_state_rank{runner.rank}.pt", map_location="cpu",
                      weights_only=False)


def save_deepspeed_final(runner: Any) -> Path:

    dist = _dist()
    out = runner.out
    with _gathered(runner):
        if runner.rank == 0:
            tmp = runner.stage_final(runner.module)
    dist.barrier()
    if runner.rank == 0:
        publish_folder(tmp, out)
        runner.write_marker(world=runner.world, deepspeed_stage=runner.cfg.deepspeed.stage)
    dist.barrier()
    return out
