"""The training engine every trainer (SFT, DPO, GRPO, PPO, PRM) runs on.

A trainer supplies three things and gets device placement, bf16, gradient accumulation, LoRA,
DeepSpeed ZeRO, checkpoints, exact resume, a progress bar and a metrics log for free::

    from train.runtime import Runner, ListSource, TrainConfig, load_model

    cfg = TrainConfig.from_sources("sft.yaml", {"lr": 1e-4, "lora.r": 8})  # YAML + overrides
    model, tokenizer = load_model(cfg)                # HF causal LM (+ peft LoRA if cfg.lora)
    source = ListSource(examples, cfg.batch_size, seed=cfg.seed)   # or any BatchSource
    def loss_fn(model, batch):                        # batch = collate(examples), on the device
        ...; return loss, {"tokens": n}                 # scalar tensor, floats to log
    Runner(cfg, model, loss_fn, source, collate, tokenizer=tokenizer).train()

Contracts:

* ``loss_fn(model, batch) -> (loss, metrics)``: ``loss`` a scalar tensor for one micro-batch
  (the runner divides it by ``grad_accum``), ``metrics`` plain floats averaged over the step's
  micro-batches and logged; a ``"tokens"`` entry is summed instead and drives tokens/s.
* a :class:`BatchSource` hands out micro-batches of examples (``next_batch``) and saves its
  position (``state_dict``/``load_state_dict``); :class:`ListSource` is the offline one
  (deterministic shuffle per epoch, sharded by rank); online trainers write their own (they may
  call ``runner.model`` to sample with the current policy).
* optimizer steps are counted in ``runner.step``; ``runner.policy_version`` is the number of
  updates the weights have had (across rounds of iterative training it keeps growing).

Output layout of ``cfg.out``: the final model as an HF folder (``config.json``, safetensors,
tokenizer; with LoRA the merged model unless ``lora.merge: false``, then the peft adapter;
the adapter is kept in ``adapter/`` either way), ``omrl-train.json`` (what produced it: written
last, so its presence means the folder is complete), ``metrics.jsonl``, ``checkpoints/step-N/``
(model or adapter, ``trainer_state.pt`` with optimizer, scheduler, RNG states, data position,
step and policy version) and ``tb/`` with ``tensorboard: true``. ``resume: true`` continues from
the newest complete checkpoint and produces, step for step, the losses of an unbroken run (on CPU
bit-exact): the metrics log is cut back to the checkpoint's step first.

Configuration lives in :mod:`train.config`, model loading in :mod:`train.models`, DeepSpeed in
:mod:`train.distributed`; the names a trainer needs are re-exported here. Nothing heavy is
imported at module level (``train.cli`` must import cheaply).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from omrl_search.host import bf16_native
from omrl_search.result import write_text_atomic

from .checkpoint_files import STATE_FILE, publish_folder
from .config import DeepSpeedSettings, LoraSettings, TrainConfig, TrainError
from .models import apply_lora, is_peft, load_model, load_weights, resolve_model_path

__all__ = ["BatchSource", "DeepSpeedSettings", "ListSource", "LoraSettings", "Runner", "TrainConfig",
           "TrainError", "apply_lora", "is_peft", "load_model", "load_weights", "publish_folder",
           "resolve_model_path"]

MARKER = "omrl-train.json"


# --- data sources ----------------------------------------------------------------------------------
class BatchSource(Protocol):
    """Hands out micro-batches of examples and remembers where it is."""

    def next_batch(self, runner: "Runner") -> list[Any] | None:
        """The next micro-batch's examples, or None when the data is exhausted."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ListSource:
    """Offline examples in a fresh deterministic order per epoch (seeded by ``seed`` and the epoch
    number, so the position ``(epoch, offset)`` is all a checkpoint needs); it cycles through
    epochs without end (the runner stops at ``max_steps``, by default ``epochs`` over the data).
    With several processes, each global batch of ``batch_size * world`` rows is split by rank
    (rank and world default to the launcher's ``RANK``/``WORLD_SIZE``)."""

    def __init__(self, examples: Sequence[Any], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, rank: int | None = None, world: int | None = None):
        if not examples:
            raise TrainError("no training examples")
        self.examples, self.batch_size, self.seed, self.shuffle = examples, batch_size, seed, shuffle
        env_rank, env_world = dist_info()
        self.rank = env_rank if rank is None else rank
        self.world = env_world if world is None else world
        if len(examples) < batch_size * self.world:
            raise TrainError(f"{len(examples)} examples cannot fill one batch of {batch_size} "
                             f"x {self.world} process(es): lower batch_size")
        self.epoch, self.offset = 0, 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.examples) // (self.batch_size * self.world))

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._order = order
        return self._order

    def next_batch(self, runner: "Runner | None" = None) -> list[Any] | None:
        if self.offset >= self.batches_per_epoch:
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
            return self.next_batch(runner)
        g = self.batch_size * self.world
        start = self.offset * g + self.rank * self.batch_size
        idx = self._epoch_order()[start:start + self.batch_size]
        self.offset += 1
        return [self.examples[i] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


# --- the runner -----------------------------------------------------------------------------------
LossFn = Callable[[Any, Any], "tuple[Any, dict[str, float]]"]


class Runner:
    """Runs ``loss_fn`` over ``source`` with one optimizer; see the module docstring.

    ``collate(examples) -> batch`` (tensors, dicts or lists of them; moved to the device);
    ``save_fn(model, folder)`` / ``load_fn(model, folder)`` replace ``save_pretrained`` and the
    safetensors loading of checkpoints for models that are not plain HF/peft models (a value
    head, a PRM head);
    ``on_step(runner, metrics)`` is called after every optimizer step (online trainers refresh
    their samplers there; raising stops the run, as a crash would). ``kind`` names the trainer
    in ``omrl-train.json``.
    """

    def __init__(self, cfg: TrainConfig, model: Any, loss_fn: LossFn, source: BatchSource,
                 collate: Callable[[list[Any]], Any] | None = None, *, tokenizer: Any = None,
                 save_fn: Callable[[Any, str], None] | None = None,
                 load_fn: Callable[[Any, str], None] | None = None,
                 on_step: Callable[["Runner", dict[str, float]], None] | None = None,
                 kind: str = "train", total_steps: int | None = None):
        import torch

        self.torch = torch
        self.cfg, self.loss_fn, self.source = cfg, loss_fn, source
        self.collate = collate or (lambda xs: xs)
        self.tokenizer, self.save_fn, self.load_fn = tokenizer, save_fn, load_fn
        self.on_step, self.kind = on_step, kind
        self.out = Path(cfg.out)
        self.step = 0
        self.policy_version = 0
        self.saving_final = False  # True while save_final writes (a save_fn may merge then)
        self.rank, self.world = dist_info()
        self.device = pick_device(cfg.device, self.rank)
        self.autocast_dtype = autocast_dtype_for(cfg.dtype, self.device)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.max_steps = cfg.max_steps or total_steps or self._steps_from_epochs()
        self.engine = None  # the DeepSpeed engine, when used
        self.model = model.to(self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise TrainError("the model has no trainable parameters")
        # fused AdamW (the HF Trainer's default too): 0.15 instead of 0.87 CPU-seconds a step for
        # SmolLM2-135M's parameters on the 2-core dev CPU; DeepSpeed gets the plain one to wrap
        fused = cfg.deepspeed is None and self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        if cfg.deepspeed is not None:
            from .distributed import deepspeed_engine

            self.engine = deepspeed_engine(self)
        self._metrics_file: Any = None
        self._tb: Any = None

    # --- schedule -------------------------------------------------------------------------
    def _steps_from_epochs(self) -> int:
        per_epoch = getattr(self.source, "batches_per_epoch", None)
        if per_epoch is None:
            raise TrainError("set max_steps: the data source has no length")
        return max(1, int(per_epoch * self.cfg.epochs) // self.cfg.grad_accum)

    def _lr_factor(self, step: int) -> float:
        warm = self.cfg.warmup_steps
        if warm and step < warm:
            return (step + 1) / warm
        if self.cfg.scheduler == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, self.max_steps - warm))
        if self.cfg.scheduler == "linear":
            return 1.0 - frac
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    # --- the loop -------------------------------------------------------------------------
    @property
    def module(self) -> Any:
        """The model itself (under DeepSpeed, the engine's module)."""
        return self.engine.module if self.engine is not None else self.model

    def autocast(self) -> Any:
        """Context for forward passes: bf16 autocast when configured, else a no-op."""
        import contextlib

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def to_device(self, obj: Any) -> Any:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=True)
        if isinstance(obj, dict):
            return {k: self.to_device(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(v) for v in obj)
        return obj

    def train(self) -> dict[str, Any]:
        """Train to ``max_steps`` (or until the data runs out), checkpointing every
        ``save_every`` steps; write the final model. Returns the last step's metrics."""
        if self.cfg.resume:
            self.resume()
        self._open_logs()
        bar = None
        if self.cfg.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=self.max_steps, initial=self.step, desc=self.kind, unit="step",
                       dynamic_ncols=True)
        last: dict[str, Any] = {}
        try:
            while self.step < self.max_steps:
                metrics = self.train_step()
                if metrics is None:
                    break
                last = metrics
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                if self.on_step is not None:
                    self.on_step(self, metrics)
                if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                    self.save_checkpoint()
        finally:
            if bar is not None:
                bar.close()
            self._close_logs()
        self.save_final()
        return last

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step over ``grad_accum`` micro-batches; None if the data ran out first."""
        t0 = time.perf_counter()
        self.model.train()
        sums: dict[str, float] = {}
        tokens, n = 0.0, 0
        for _ in range(self.cfg.grad_accum):
            examples = self.source.next_batch(self)
            if examples is None:
                break
            batch = self.to_device(self.collate(examples))
            with self.autocast():
                loss, metrics = self.loss_fn(self.module, batch)
            if self.engine is not None:
                self.engine.backward(loss)  # DeepSpeed divides by grad_accum itself
                self.engine.step()  # and steps the optimizer at the accumulation boundary
            else:
                (loss / self.cfg.grad_accum).backward()
            n += 1
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                if k == "tokens":
                    tokens += float(v)
                else:
                    sums[k] = sums.get(k, 0.0) + float(v)
        if n == 0:
            return None
        if n < self.cfg.grad_accum and self.engine is None:  # a short last step: rescale
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.cfg.grad_accum / n)
        grad_norm = self._optimizer_step()
        if self.world > 1:
            sums, tokens = self._reduce(sums, tokens)
        self.step += 1
        self.policy_version += 1
        dt = time.perf_counter() - t0
        out: dict[str, Any] = {"step": self.step, **{k: v / n for k, v in sums.items()}}
        out.update(lr=self.scheduler.get_last_lr()[0] if self.engine is None else _ds_lr(self.engine),
                   grad_norm=grad_norm, tokens=int(tokens), seconds=round(dt, 4),
                   tokens_per_s=round(tokens / dt, 1) if dt > 0 else 0.0,
                   policy_version=self.policy_version)
        if self.step % self.cfg.log_every == 0 or self.step == self.max_steps:
            self.log(out)
        return out

    def _reduce(self, sums: dict[str, float], tokens: float) -> tuple[dict[str, float], float]:
        """Metrics averaged over processes (tokens summed), so the log shows the global step."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return sums, tokens
        keys = sorted(sums)
        t = self.torch.tensor([sums[k] for k in keys] + [tokens], dtype=self.torch.float64,
                              device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world for k, v in zip(keys, t[:-1])}, float(t[-1])

    def _optimizer_step(self) -> float:
        torch = self.torch
        if self.engine is not None:
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.detach().norm() for p in params]))) if params else 0.0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # --- logging --------------------------------------------------------------------------
    def _open_logs(self) -> None:
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        if path.exists():  # keep what the run being resumed logged up to its checkpoint
            kept = [ln for ln in metric_lines(path) if json.loads(ln).get("step", 0) <= self.step]
            write_text_atomic(path, "".join(ln + "\n" for ln in kept))
        self._metrics_file = path.open("a")
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainError("tensorboard: true needs the tensorboard package") from None
            self._tb = SummaryWriter(str(self.out / "tb"), purge_step=self.step + 1)

    def _close_logs(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    @property
    def logging(self) -> bool:
        """Whether ``metrics.jsonl`` is open (rank 0, during training)."""
        return self._metrics_file is not None

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one line to ``metrics.jsonl`` (and TensorBoard); rank 0 only."""
        if self._metrics_file is None:
            return
        self._metrics_file.write(json.dumps(metrics) + "\n")
        self._metrics_file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{self.kind}/{k}", v, metrics["step"])

    # --- checkpoints ----------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """``checkpoints/step-N``: model (or adapter), optimizer, scheduler, RNG states, data
        position, step and policy version; written under a temporary name, then renamed."""
        final = self.checkpoint_dir / f"step-{self.step:07d}"
        if self.engine is not None:
            from .distributed import save_deepspeed_checkpoint

            save_deepspeed_checkpoint(self, final)
            return final
        tmp = self.checkpoint_dir / f".tmp-step-{self.step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._save_model(self.model, tmp / "model", merge=False)
        self.torch.save(self.trainer_state(), tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self.prune_checkpoints()
        return final

    def trainer_state(self) -> dict[str, Any]:
        state = {"step": self.step, "policy_version": self.policy_version,
                 "source": self.source.state_dict(), "rng": rng_state(self.torch),
                 "kind": self.kind}
        if self.engine is None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def prune_checkpoints(self) -> None:
        """Delete finished checkpoints beyond the newest ``keep_checkpoints``."""
        done = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / STATE_FILE).exists())
        for old in done[:-self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / STATE_FILE).exists())
        return done[-1] if done else None

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the newest (or the given) checkpoint; False when there is none."""
        ckpt = Path(path) if path else self.latest_checkpoint()
        if ckpt is None:
            return False
        if self.engine is not None:
            from .distributed import load_deepspeed_checkpoint

            state = load_deepspeed_checkpoint(self, ckpt)
        else:
            self._load_weights(ckpt / "model")
            state = self.torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])
        self.source.load_state_dict(state["source"])
        set_rng_state(self.torch, state["rng"])
        return True

    def _load_weights(self, folder: Path) -> None:
        if self.load_fn is not None:
            self.load_fn(self.model, str(folder))
        else:
            load_weights(self.model, folder)

    def _save_model(self, model: Any, folder: Path, *, merge: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.save_fn is not None:
            self.save_fn(model, str(folder))
        elif is_peft(model) and merge:
            import copy

            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(folder, safe_serialization=True)
        else:
            model.save_pretrained(folder, safe_serialization=True)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)

    def save_final(self) -> Path:
        """The final model into ``out`` (files moved in from a temporary folder, the marker
        ``omrl-train.json`` last); with LoRA also the adapter into ``out/adapter``."""
        if self.engine is not None:
            from .distributed import save_deepspeed_final

            return save_deepspeed_final(self)
        if self.rank != 0:
            return self.out
        tmp = self.stage_final(self.model)
        if is_peft(self.model):
            self._save_model(self.model, tmp / "adapter", merge=False)
        publish_folder(tmp, self.out)
        self.write_marker()
        return self.out

    def stage_final(self, model: Any) -> Path:
        """Rank 0: clear the old marker and save ``model`` (LoRA merged unless configured not
        to) into ``out/.tmp-final``, which :func:`publish_folder` then moves into ``out``."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MARKER).unlink(missing_ok=True)
        tmp = self.out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        self.saving_final = True
        try:
            self._save_model(model, tmp, merge=self.cfg.lora is None or self.cfg.lora.merge)
        finally:
            self.saving_final = False
        return tmp

    def write_marker(self, **extra: Any) -> None:
        info = {"kind": self.kind, "step": self.step, "policy_version": self.policy_version,
                "base_model": self.cfg.model, "lora": self.cfg.lora is not None,
                "compute_dtype": "bfloat16" if self.autocast_dtype is not None else "float32",
                "config": self.cfg.model_dump(mode="json"), **extra}
        write_text_atomic(self.out / MARKER, json.dumps(info, indent=2) + "\n")


# --- helpers ------------------------------------------------------------------------------------------
def dist_info() -> tuple[int, int]:
    """(rank, world size) from the usual launcher variables (1 process when unset)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def pick_device(spec: str, rank: int = 0) -> Any:
    import torch

    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(spec)


def autocast_dtype_for(dtype: str, device: Any) -> Any:
    """bf16 autocast when asked, or under ``auto`` where bf16 is native: a CUDA GPU that has it, a
    CPU with AMX / AVX512-BF16. On an AVX2-only CPU bf16 is emulated (an SFT step ran about 20x
    slower than fp32 there), so ``auto`` keeps fp32; None means fp32."""
    import torch

    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and bf16_native()
        return torch.bfloat16 if native else None
    return None


def rng_state(torch: Any) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(torch: Any, state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _ds_lr(engine: Any) -> float:
    lrs = engine.get_lr()
    return float(lrs[0]) if lrs else 0.0


def metric_lines(path: Path) -> list[str]:
    """The complete lines of a ``metrics.jsonl`` being resumed. A torn last line (the process
    was killed while writing it) is dropped; a bad line anywhere else is a TrainError naming
    ``file:line``, since the log was damaged by something other than a kill."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    for i, ln in enumerate(lines, 1):
        try:
            json.loads(ln)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                return lines[:-1]
            raise TrainError(f"{path}:{i}: not a JSON line ({exc.msg}); remove it to resume") from None
    return lines
