#!/usr/bin/env bash
# The offline wheelhouse for an air-gapped GPU node with the site image (issue 37): exactly the
# wheels the image lacks and the GPU check imports (tools/gpu_image.py WHEELHOUSE), for
# CPython 3.12 manylinux x86-64, no dependencies (the image has them), then DIR/MANIFEST.tsv
# (name, version, sha256, bytes, total). Fails over 48 MiB (the whole tree travels in 64 MiB).
#
#   bash scripts/wheelhouse.sh [DIR]        # default: wheelhouse/ (git-ignored)
#
# On the GPU node: bash tools/gpu_check.sh --wheelhouse wheelhouse (docs/tools.md "GPU check").
# Checked by tests/launch/test_gpu_image.py (the list covers every import; the size rule) and by
# scripts/rehearse_gpu_image.sh (the image's versions plus only these wheels run the check).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheelhouse}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" tools/gpu_image.py wheelhouse-requirements > "$DIR/requirements.txt"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform any \
  -r "$DIR/requirements.txt" -d "$DIR"
"$PY" tools/gpu_image.py manifest "$DIR"
