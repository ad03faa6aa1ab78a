"""Loading the model to train (HF folder, GGUF or the bundled SmolLM2), LoRA, checkpoint weights."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omrl_search.specs import error_line

from .config import LoraSettings, TrainConfig, TrainError


def resolve_model_path(spec: str) -> tuple[str, str | None]:
    """``smollm2`` -> the cached HF folder converted from the bundled GGUF; ``DIR/x.gguf`` ->
    (DIR, x.gguf) to load with ``gguf_file=``; a folder -> itself."""
    if spec == "smollm2":
        from omrl_search.backends.smollm2 import hf_folder

        return hf_folder(), None
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return folder, name
    if not os.path.exists(path):
        raise TrainError(f"model {spec!r} does not exist (an HF folder, a .gguf file or 'smollm2')")
    return path, None


def load_model(cfg: TrainConfig, *, model_class: Any = None, with_lora: bool = True,
               **kwargs: Any) -> tuple[Any, Any]:
    """The model (fp32 weights; on the device only once a Runner takes it) and its HF
    tokenizer; wrapped with peft LoRA when ``cfg.lora`` is set. ``model_class`` defaults to
    ``AutoModelForCausalLM`` (a PRM trainer passes its own)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)  # LoRA (and any new head) initialisation is part of the run
    path, gguf = resolve_model_path(cfg.model)
    extra = {"gguf_file": gguf} if gguf else {}
    cls = model_class or AutoModelForCausalLM
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        model = cls.from_pretrained(path, dtype=torch.float32, **extra, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one line for any loading failure
        raise TrainError(f"cannot load {cfg.model!r}: {error_line(exc)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gguf:
        dequantized(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.lora is not None and with_lora:
        model = apply_lora(model, cfg.lora)
    return model, tokenizer


def dequantized(model: Any) -> Any:
    """A model loaded with ``gguf_file=`` holds plain float weights (dequantised) but is still
    flagged as quantized, which ``save_pretrained`` and the HF Trainer refuse: drop the flags."""
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    return model


def apply_lora(model: Any, lora: LoraSettings) -> Any:
    """Wrap ``model`` in a peft LoRA adapter (only the adapter is trainable)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TrainError("lora needs peft: pip install peft") from None
    conf = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, bias="none")
    return get_peft_model(model, conf)


def is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def load_weights(model: Any, folder: str | Path) -> None:
    """Load a checkpoint folder written by ``save_pretrained`` into ``model`` in place: the
    adapter for a peft model, else every ``model*.safetensors`` shard (tied weights may be
    absent)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if is_peft(model):
        from peft import set_peft_model_state_dict

        adapter = folder / "adapter_model.safetensors"
        if not adapter.is_file():
            raise TrainError(f"{folder}: checkpoint holds no adapter weights")
        set_peft_model_state_dict(model, load_file(str(adapter)))
        return
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise TrainError(f"{folder}: checkpoint holds no weights")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # transformers' public map of tied weights
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied.add("lm_head.weight")
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise TrainError(f"{folder}: weights do not fit the model "
                         f"(missing {missing[:2]}, unexpected {unexpected[:2]})")


