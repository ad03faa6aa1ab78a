"""What a measurement ran on: the CPU, whether it has native bf16, and the policy's dtype.

Seeded runs of a real model depend on the host: the bundled model runs in bfloat16 on CPUs with
native bf16 (AMX or AVX512-BF16) and in float32 elsewhere, and bf16 sampling is not bit-stable
across batch shapes (docs/reliability.md, "Seeds and the host"). So every ``summary.json``,
bench table and loop report records :func:`host_info` and the policy's :func:`policy_dtype`.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from typing import Any

#: the /proc/cpuinfo flags that mean bf16 matmuls run natively (not emulated)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_native() -> bool:
    """Whether this CPU computes bf16 natively (AMX or AVX512-BF16)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def host_info() -> dict[str, Any]:
    """``{"cpu", "cores", "bf16_native"}`` of this machine."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "bf16_native": bf16_native()}


def policy_dtype(policy: Any) -> str | None:
    """The dtype a policy computes in: ``float32``/``bfloat16``/``float16`` for torch backends
    (their ``dtype``), ``gguf`` for llama.cpp (quantised weights, its own kernels), None for
    policies that run no model (scripted) or are only named by a spec string."""
    dtype = getattr(policy, "dtype", None)
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    if getattr(policy, "model_path", None) is not None:
        return "gguf"
    return None


def describe(info: dict[str, Any], dtype: str | None) -> str:
    """One line for a table: ``host: CPU (N cores, bf16 native|emulated), dtype: X``."""
    native = "bf16 native" if info.get("bf16_native") else "bf16 emulated"
    return f"host: {info.get('cpu')} ({info.get('cores')} cores, {native}), dtype: {dtype or 'n/a'}"
