#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh Debian machine: apt packages (real text corpora,
# Open MPI, Slurm), a virtual environment in .venv with the pinned CPU torch and
# megatron-core, and this package in editable mode with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(bible-kjv bible-kjv-text dict-gcide dict-foldoc dict-jargon python3.11-doc
              openmpi-bin libopenmpi-dev slurm-wlm munge)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] missing apt packages (need root): ${missing[*]}" >&2
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.mvmoe-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  echo "[setup] pip install (torch CPU, megatron-core 0.16.1, project with dev extras)"
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -W ignore -c "import torch, megatron.core, triton, mpi4py"
  touch "$stamp"
fi
echo "[setup] ready: $(.venv/bin/python -W ignore -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)' 2>/dev/null)"
