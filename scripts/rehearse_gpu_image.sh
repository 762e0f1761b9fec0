#!/usr/bin/env bash
# CPU rehearsal of the GPU run on the site image (issue 37): an environment with the image's
# Python-level versions (tools/gpu_image.py IMAGE: torch 2.11.0, triton 3.6.0, transformers
# 5.17.0, ...; no megatron-core), the wheelhouse (scripts/wheelhouse.sh) installed only with
# --no-index --no-deps --target, and tools/gpu_check.sh --wheelhouse wheelhouse --cpu-smoke run
# from a copy of the repository without .venv (the files git would carry). Every stage must
# exit 0; the log is $DIR/rehearsal.log, the check's results $DIR/out.
#
#   bash scripts/rehearse_gpu_image.sh           # reuses $DIR/env if built for the same pins
#   bash scripts/rehearse_gpu_image.sh --fresh   # rebuilds the environment from the cache
#
# DIR is $REHEARSAL_DIR or runs/rehearsal (git-ignored). PyPI's torch 2.11.0 for Python 3.12 is
# the CUDA build: it does not import without its nvidia-* wheels, so the environment has them
# (~2.6 GB, cached in $DIR/image-wheels; pip download runs only when the cache lacks a pin).
# Timings (docs/gpu.md): cold ~10 min on 2 loaded cores; warm 5 min at load ~20, 12 min at
# load 30-90 (measured with REHEARSAL_DIR=/work/rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${REHEARSAL_DIR:-runs/rehearsal}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
FRESH=0
[ "${1:-}" = "--fresh" ] && FRESH=1
exec > >(tee "$DIR/rehearsal.log") 2>&1
unset PYTHONPATH  # the host's checkout must not leak into the rehearsal
T0=$SECONDS
say() { echo "[rehearsal $((SECONDS - T0)) s] $*"; }

find_python312() {  # the image's interpreter is CPython 3.12
  local c root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for c in "${PYTHON312:-}" python3.12 "$root"/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
      > /dev/null 2>&1 && { echo "$c"; return 0; }
  done
  echo "[rehearsal] no CPython 3.12 found. Fix: install it or set PYTHON312" >&2
  return 1
}

build_env() {  # $DIR/env with the image's pins, from the wheel cache (download what it lacks)
  local base=$1 pins=$DIR/image-requirements.txt
  "$base" tools/gpu_image.py image-requirements > "$pins"
  if [ "$FRESH" = 0 ] && cmp -s "$pins" "$DIR/env/pins.txt" 2>/dev/null; then
    say "environment $DIR/env already has these pins (--fresh rebuilds it)"; return 0
  fi
  rm -rf "$DIR/env"
  "$base" -m venv "$DIR/env"
  local pip=("$DIR/env/bin/python" -m pip install --quiet --no-index --find-links "$DIR/image-wheels")
  if ! "${pip[@]}" -r "$pins" 2> /dev/null; then
    say "downloading the image's wheels into $DIR/image-wheels"
    "$DIR/env/bin/python" -m pip download --quiet -d "$DIR/image-wheels" -r "$pins"
    "${pip[@]}" -r "$pins"
  fi
  cp "$pins" "$DIR/env/pins.txt"
}

copy_repository() {  # what travels: tracked and untracked-but-not-ignored files, no .venv
  rm -rf "$DIR/repo" "$DIR/out"
  mkdir -p "$DIR/repo"
  git -C "$ROOT" ls-files -co --exclude-standard -z | xargs -0 tar -C "$ROOT" -cf - \
    | tar -C "$DIR/repo" -xf -
}

BASE=$(find_python312)
say "python $("$BASE" -V 2>&1) ($BASE)"
build_env "$BASE"
PY=$DIR/env/bin/python
say "environment: $("$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)')"
if "$PY" -c "import megatron.core" 2> /dev/null; then
  echo "[rehearsal] the environment has megatron-core: it is not the site image" >&2; exit 1
fi
copy_repository
cd "$DIR/repo"
[ ! -e .venv ] || { echo "[rehearsal] the copy has a .venv" >&2; exit 1; }
PYTHON=$PY bash scripts/wheelhouse.sh wheelhouse
say "wheelhouse: $(tail -n 1 wheelhouse/MANIFEST.tsv | cut -f4) bytes"
set +e
PYTHON=$PY OUT=$DIR/out bash tools/gpu_check.sh --wheelhouse wheelhouse --cpu-smoke
rc=$?
set -e
say "tools/gpu_check.sh --wheelhouse wheelhouse --cpu-smoke: exit $rc (stages: $DIR/out/stages.tsv)"
exit "$rc"
