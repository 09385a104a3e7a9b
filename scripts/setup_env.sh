#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install lit-seqpack with its dev and docs extras (the tests
# build the docs site).
# Where no NVIDIA GPU is visible, torch is pinned to the CPU wheel first so that no CUDA wheels are pulled.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.5"
  else
    "${pip[@]}" "torch==2.13.0" || "${pip[@]}" "torch>=2.5" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" -e ".[dev,docs,litdata]"
# litdata (LitDataStream's tests): its requirements pull torchvision and another torch, so it is installed without
# them; the litdata extra above brings what it needs besides torch
"${pip[@]}" --no-deps "litdata>=0.2.76"
