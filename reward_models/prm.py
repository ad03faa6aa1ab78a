"""The learned process reward model (PRM) and its outcome variant (ORM).

A PRM is an HF causal-LM backbone (loaded as its base model, without the LM head) plus a scalar
head read at the end of every agent step (see :mod:`reward_models.inputs` for what is read where);
``sigmoid(logit)`` is the step's score, an estimate of the chance that the task still succeeds.
The outcome variant (:mod:`reward_models.orm`) is the same model read at the last step only.

A saved model is an ordinary HF folder (``config.json``, weights, tokenizer) plus
``reward_head.safetensors`` and ``reward_model.json`` (kind, read position, input mode,
aggregation); :meth:`ProcessRewardModel.from_pretrained` loads it on CPU or GPU.

Spec: ``prm:PATH`` with options after another colon, e.g.
``prm:runs/prm:aggregation=min,batch_size=16,device=cpu``.

Scoring is batched: the engine hands over every prefix of a search round at once; prefixes are
sorted by length and run in chunks of ``batch_size`` (right-padded, one forward each). A cache
across calls (on by default; ``prefix_cache=off``, ``prefix_cache_mb=N``;
:mod:`reward_models.prefix_scoring`) reads a parent's steps from a memo and runs only the tokens
after the longest cached prefix, so a child's score costs its new tokens, not its whole episode.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator, Sequence

from omrl_search.prefix_cache import cache_limit
from omrl_search.reward import AGGREGATIONS, RewardModel, Scored, register_reward_model
from omrl_search.specs import split_path_spec
from omrl_search.tree import Trajectory
from omrl_search.types import Usage

from .inputs import INPUTS, READS, Episode, StepEncoder, episode_from_trajectory
from .prefix_scoring import DEFAULT_CACHE_MB, PrefixScorer

CONFIG_NAME = "reward_model.json"
HEAD_NAME = "reward_head.safetensors"
FORMAT_VERSION = 1


def resolve_base(base: str) -> str:
    """``smollm2`` -> the bundled model's HF folder; anything else is taken as an HF folder."""
    if base in ("smollm2", "smollm2:hf"):
        from omrl_search.backends.smollm2 import hf_folder

        return hf_folder()
    return os.path.expanduser(base)


def _device_dtype(device: str, dtype: str) -> tuple[Any, Any]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r} (float32, bfloat16, float16 or auto)")
    return dev, getattr(torch, dtype)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' load report (the backbone's checkpoint has an LM head the base
    model does not use) and its progress bars while loading."""
    from transformers.utils import logging as tlog

    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from omrl_search.backends.hf_tokenizer import HFChatTokenizer

    return HFChatTokenizer(AutoTokenizer.from_pretrained(path))


class ProcessRewardModel(RewardModel):
    """Per-step scores from a backbone and a scalar head (see the module docstring)."""

    kind = "prm"

    def __init__(self, model: Any, tokenizer: Any, *, read: str = "observation",
                 input: str = "auto", aggregation: str = "last", batch_size: int = 8,
                 max_length: int = 2048, path: str | None = None, prefix_cache: Any = True,
                 prefix_cache_mb: Any = DEFAULT_CACHE_MB):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
        self.model, self.tokenizer = model, tokenizer
        self.aggregation, self.batch_size = aggregation, int(batch_size)
        self.encoder = StepEncoder(tokenizer, read=read, input=input, max_length=max_length)
        self.path = path
        self.name = f"{self.kind}:{path}" if path else self.kind
        self.prefix = _prefix_scorer(prefix_cache, prefix_cache_mb)

    # --- building, loading, saving ------------------------------------------------------------
    @classmethod
    def from_base(cls, base: str, *, read: str = "observation", input: str = "auto",
                  aggregation: str = "last", keep_layers: int | None = None, device: str = "auto",
                  dtype: str = "auto", seed: int = 0, **kwargs: Any) -> "ProcessRewardModel":
        """A new reward model: the backbone of ``base`` (an HF folder or ``smollm2``), cut to
        its bottom ``keep_layers`` blocks if given, and a freshly initialised head."""
        import torch
        from transformers import AutoModel

        from ._net import ValueHeadModel, keep_bottom_layers

        folder = resolve_base(base)
        if not os.path.isdir(folder):
            raise ValueError(f"base model {base!r}: no such folder")
        dev, dt = _device_dtype(device, dtype)
        try:
            with _quiet():
                backbone = AutoModel.from_pretrained(folder, dtype=dt)
                tokenizer = _load_tokenizer(folder)
        except Exception as exc:  # noqa: BLE001 - one line for any loading failure
            raise ValueError(f"base model {base!r}: cannot load: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
        if keep_layers is not None:
            keep_bottom_layers(backbone, int(keep_layers))
        torch.manual_seed(seed)
        model = ValueHeadModel(backbone)
        model.head.to(torch.float32)
        model.to(dev).eval()
        return cls(model, tokenizer, read=read, input=input, aggregation=aggregation, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "auto", dtype: str = "auto",
                        **overrides: Any) -> "ProcessRewardModel":
        """Load a folder written by :meth:`save_pretrained`; ``overrides`` replace the saved
        ``read`` / ``input`` / ``aggregation`` / ``batch_size`` / ``max_length``."""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel

        from ._net import ValueHeadModel

        path = os.path.expanduser(path)
        cfg_path = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{path}: not a saved reward model (no {CONFIG_NAME})")
        with open(cfg_path) as fh:
            cfg = json.load(fh)
        dev, dt = _device_dtype(device, dtype)
        try:
            with _quiet():
                backbone = AutoModel.from_pretrained(path, dtype=dt)
                tokenizer = _load_tokenizer(path)
            head = load_file(os.path.join(path, HEAD_NAME))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: cannot load the reward model: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
        model = ValueHeadModel(backbone)
        model.head.to(torch.float32).load_state_dict(head)
        model.to(dev).eval()
        opts = {k: cfg[k] for k in ("read", "input", "aggregation", "batch_size", "max_length") if k in cfg}
        opts.update(overrides)
        return cls(model, tokenizer, path=path, **opts)

    def config(self) -> dict[str, Any]:
        e = self.encoder
        return {"kind": self.kind, "format_version": FORMAT_VERSION, "read": e.read,
                "input": e.input, "aggregation": self.aggregation, "batch_size": self.batch_size,
                "max_length": e.max_length}

    def save_pretrained(self, path: str) -> None:
        """Write backbone, tokenizer, head and config to ``path`` (a temporary folder renamed
        into place, so a crash leaves no half-written model)."""
        path = os.path.abspath(os.path.expanduser(path))
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".rm-tmp-", dir=parent)
        try:
            self.write_files(tmp)
            os.chmod(tmp, 0o755)
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.rename(tmp, path)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def write_files(self, folder: str) -> None:
        """The files of a saved model, into an existing folder (what checkpoints hold)."""
        from safetensors.torch import save_file

        self.model.backbone.save_pretrained(folder)
        self.tokenizer.hf.save_pretrained(folder)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.model.head.state_dict().items()},
                  os.path.join(folder, HEAD_NAME))
        with open(os.path.join(folder, CONFIG_NAME), "w") as fh:
            json.dump(self.config(), fh, indent=2)

    def load_weights(self, folder: str) -> None:
        """Load backbone and head weights written by :meth:`write_files` into this model."""
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors") and name != HEAD_NAME:
                state.update(load_file(os.path.join(folder, name)))
        if not state:
            raise ValueError(f"{folder}: no backbone weights")
        self.model.backbone.load_state_dict(state, strict=True)
        self.model.head.load_state_dict(load_file(os.path.join(folder, HEAD_NAME)))
        self.clear_cache()  # memoised scores belong to the weights just replaced

    # --- batching -------------------------------------------------------------------------------
    @property
    def device(self) -> Any:
        return self.model.head.weight.device

    def collate(self, encoded: Sequence[tuple[list[int], list[int]]], device: Any = None) -> dict[str, Any]:
        """Right-padded ``input_ids`` / ``attention_mask`` and ``positions`` (+ ``step_mask``)."""
        import torch

        pad = self.tokenizer.pad_token_id
        B = len(encoded)
        T = max(len(ids) for ids, _ in encoded)
        S = max(max(len(pos) for _, pos in encoded), 1)
        ids_t = torch.full((B, T), pad, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        pos_t = torch.zeros((B, S), dtype=torch.long)
        step_mask = torch.zeros((B, S), dtype=torch.bool)
        for b, (ids, pos) in enumerate(encoded):
            ids_t[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[b, :len(ids)] = 1
            if pos:
                pos_t[b, :len(pos)] = torch.tensor(pos, dtype=torch.long)
                step_mask[b, :len(pos)] = True
        dev = self.device if device is None else device
        return {"input_ids": ids_t.to(dev), "attention_mask": mask.to(dev),
                "positions": pos_t.to(dev), "step_mask": step_mask.to(dev)}

    def logits(self, batch: dict[str, Any]) -> Any:
        """``[batch, steps]`` logits (the trainer's forward)."""
        return self.model(batch["input_ids"], batch["attention_mask"], batch["positions"])

    def encode(self, ep: Episode) -> tuple[list[int], list[int]]:
        ids, pos = self.encoder.encode(ep)
        return ids, pos

    # --- scoring --------------------------------------------------------------------------------
    def scored(self, prefixes: list[Trajectory]) -> Scored:
        return Scored(*self.run_episodes([episode_from_trajectory(t) for t in prefixes]))

    def score(self, prefixes: list[Trajectory]) -> list[list[float]]:
        return self.scored(prefixes).steps

    def score_episodes(self, episodes: Sequence[Episode]) -> list[list[float]]:
        """Per-step scores in [0, 1] of each episode (``[]`` for an episode with no steps)."""
        return self.run_episodes(episodes)[0]

    def run_episodes(self, episodes: Sequence[Episode]) -> tuple[list[list[float]], list[Usage]]:
        """Per-step scores of each episode and the tokens run for it (its encoded length as
        ``prompt_tokens``, what the prefix cache served as ``cached_tokens``); through the
        prefix cache when it is on (:mod:`reward_models.prefix_scoring`)."""
        import math

        import torch

        out: list[list[float]] = [[] for _ in episodes]
        todo = [(i, self.encode(ep)) for i, ep in enumerate(episodes) if len(ep)]
        todo.sort(key=lambda t: len(t[1][0]))
        usage = [Usage()] * len(episodes)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                if self.prefix is not None:
                    got, cost = self.prefix.logits(self.model, [e for _, e in todo], self.batch_size,
                                                   self.tokenizer.pad_token_id)
                    for (i, (ids, _)), row, c in zip(todo, got, cost):
                        out[i] = [1.0 / (1.0 + math.exp(-v)) for v in row]
                        n = max(len(ids), c)  # c: the tokens forwarded for it
                        usage[i] = Usage(prompt_tokens=n, cached_tokens=n - c)
                    return out, usage
                for start in range(0, len(todo), self.batch_size):
                    chunk = todo[start:start + self.batch_size]
                    probs = torch.sigmoid(self.logits(self.collate([e for _, e in chunk])).float())
                    for row, (i, (ids, pos)) in zip(probs.tolist(), chunk):
                        out[i] = row[:len(pos)]
                        usage[i] = Usage(prompt_tokens=len(ids))
        finally:
            self.model.train(was_training)
        return out, usage

    def stats(self) -> dict[str, Any]:
        """The prefix cache's counters (steps read from the memo, tokens forwarded), when on."""
        return {} if self.prefix is None else {"prefix_cache": self.prefix.stats()}

    def clear_cache(self) -> None:
        """Forget memoised scores: call after the weights change (training, a load)."""
        if self.prefix is not None:
            self.prefix.clear()


def _prefix_scorer(on: Any, mb: Any) -> PrefixScorer | None:
    """The ``prefix_cache`` / ``prefix_cache_mb`` options as a scorer (None: off)."""
    limit = cache_limit(on, mb)
    return None if limit is None else PrefixScorer(limit)


_OPTIONS = {"device", "dtype", "aggregation", "read", "input", "batch_size", "max_length",
            "prefix_cache", "prefix_cache_mb"}


def load_spec(cls: type, arg: str) -> ProcessRewardModel:
    path, opts = split_path_spec(arg, "reward model options")
    if not path:
        raise ValueError(f"{cls.kind}: give a saved model folder, e.g. {cls.kind}:runs/prm")
    bad = sorted(set(opts) - _OPTIONS)
    if bad:
        raise ValueError(f"{cls.kind}: unknown option(s) {', '.join(bad)} (known: {', '.join(sorted(_OPTIONS))})")
    for key, allowed in (("read", READS), ("input", INPUTS), ("aggregation", AGGREGATIONS)):
        if key in opts and opts[key] not in allowed:
            raise ValueError(f"{cls.kind}: {key} must be one of {', '.join(allowed)}, got {opts[key]!r}")
    return cls.from_pretrained(path, **opts)


@register_reward_model("prm")
def _prm(arg: str) -> ProcessRewardModel:
    return load_spec(ProcessRewardModel, arg)
