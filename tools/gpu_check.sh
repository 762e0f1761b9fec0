#!/usr/bin/env bash
# GPU check: everything that needs a GPU, in one go (<= 8 minutes on one H100/H200, the
# wheelhouse install included: every stage's timeout is cut to what is left of the budget).
#
#   bash tools/gpu_check.sh                 # on a GPU machine; results in $OUT or runs/gpu_check
#   bash tools/gpu_check.sh --cpu-smoke     # same stages, tiny sizes, on CPU (tests use this)
#   bash tools/gpu_check.sh --wheelhouse wheelhouse   # a site image without megatron-core:
#       installs scripts/wheelhouse.sh's wheels (--no-index --no-deps --target $OUT/site),
#       then runs with PYTHONPATH=$OUT/site (scripts/rehearse_gpu_image.sh rehearses it on CPU)
#
# Stages (each bounded by `timeout`; a failing stage says why in one line, the next one runs):
#   0. wheelhouse (with --wheelhouse) and imports: every package module imports on this
#      image (tools/gpu_image.py imports; optional extras are named and skipped)
#   1. the `gpu`-marked tests (compiled Triton kernels against their torch references, ...)
#   2. tools/kernel_resources.py (AOT compile for sm_90/sm_100, registers/spills; GPU mode)
#      and tools/bench_kernels.py: fused routing and mix+permute kernels vs references
#   3. tools/bench_moe_layer.py --preset mvmoe_10b_a1b: one 10B-A1B MoE layer at real size,
#      forward + backward per variant (latent baseline, Multi-Router, Multi-View) with the
#      GPU fast paths: achieved TFLOP/s, peak memory, MV/baseline time ratio
#   3b. tools/bench_attention.py: the core attention on torch SDPA vs Megatron's unfused one
#      (no TransformerEngine on the image): which aten SDPA kernel ran (flash / efficient /
#      cudnn / math), torch.backends.cuda's switches, TFLOP/s of each, the time ratio
#   4. tools/plan.py --fast-paths --target here: which fast path this machine takes and why
#      not the others (no TransformerEngine on the site image)
#   5. 20 training steps of the tiny Multi-View model through the whole stack (bf16, grouped
#      experts, overlapped DDP) on one GPU, saving at step 10 and 20; then resumed from step
#      10: steps 11..20 must equal the first run's bit for bit, the loss fall, no NaN
# Then $OUT/summary.json: each stage's exit status, seconds and one-line reason, the layer
# figures and the resume verdict.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
WHEELHOUSE=
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) MODE=cpu-smoke ;;
    --wheelhouse) WHEELHOUSE=${2:-}; shift ;;
    *) echo "[gpu_check] unknown argument $1. Fix: use --cpu-smoke and/or --wheelhouse DIR" >&2
       exit 2 ;;
  esac
  shift
done
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3 || command -v python)  # a site image's own
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}  # 8 minutes for everything, the install included
# the CPU smoke's budget is for a shared 2-core machine (imports alone take ~1 min there)
[ "$MODE" = cpu-smoke ] && BUDGET_S=${GPU_CHECK_BUDGET_S:-1500}
mkdir -p "$OUT"
STATUS="$OUT/stages.tsv"
: > "$STATUS"
# the repository itself is imported from the checkout, not installed (`tools/*.py` scripts
# put only tools/ on sys.path)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

record() {  # record NAME RC SECONDS REASON
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STATUS"
}

last_line() {  # the last non-empty line of a stage's stderr, else of its stdout
  local line
  line=$(grep -v '^[[:space:]]*$' "$OUT/$1.err" 2>/dev/null | tail -n 1)
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$OUT/$1.out" 2>/dev/null | tail -n 1)
  printf '%s' "${line:0:300}" | tr '\t' ' '
}

stage() {  # stage NAME TIMEOUT_S CMD...  (the timeout is cut to what is left of BUDGET_S)
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 10 ]; then
    record "$name" 124 0 "skipped: the ${BUDGET_S} s budget is spent"
    echo "[gpu_check] $name: skipped, the ${BUDGET_S} s budget is spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "[gpu_check] $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$? reason=""
  if [ "$rc" = 124 ]; then reason="timed out after $limit s"
  elif [ "$rc" != 0 ]; then reason=$(last_line "$name"); fi
  record "$name" "$rc" "$((SECONDS - start))" "$reason"
  echo "[gpu_check] $name: exit $rc in $((SECONDS - start)) s${reason:+: $reason}"
}

install_wheelhouse() {  # pip install --no-index --no-deps --target $OUT/site DIR/*.whl
  [ -n "$WHEELHOUSE" ] || return 0
  if ! ls "$WHEELHOUSE"/*.whl > /dev/null 2>&1; then
    echo "[gpu_check] --wheelhouse $WHEELHOUSE: no wheels there. Fix: run" \
         "scripts/wheelhouse.sh $WHEELHOUSE where PyPI is reachable and bring the folder" >&2
    exit 2
  fi
  stage wheelhouse 120 "$PY" -m pip install --quiet --no-index --no-deps --upgrade \
        --target "$OUT/site" "$WHEELHOUSE"/*.whl
  export PYTHONPATH="$(cd "$OUT" && pwd)/site:$PYTHONPATH"
}

gpu_stages() {
  stage gpu_tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
  stage kernel_resources 60 "$PY" tools/kernel_resources.py --json  # AOT sm_90/sm_100 compiles
  stage kernels 60 "$PY" tools/bench_kernels.py --tokens 16384 --experts 128 --heads 2 \
        --topk 8 --latent 256 --dtype bf16 --json  # the mvmoe_10b_a1b layer's E, R, S, L
  stage layer_10b 100 "$PY" tools/bench_moe_layer.py --preset mvmoe_10b_a1b --dtype bf16 \
        --tokens 16384 --warmup 3 --repeats 10 --json
  stage attention 90 "$PY" tools/bench_attention.py --dtype bf16 --clock wall --heads 16 \
        --head-dim 128 --seq 4096 --batch 2 --rounds 10 --json
  TRAIN_ARGS=(--train-iters 20 --save-interval 10 --lr-warmup-iters 2
              --expert-model-parallel-size 1 --precision bf16)
  RESUME_AT=10 TRAIN_S=120 RESUME_S=90
}

cpu_smoke_stages() {
  stage gpu_tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider --collect-only tests
  # the AOT compile needs no GPU: on a site image's Triton (the rehearsal) it proves that
  # Triton builds every kernel for sm_90 (the normal suite has tests/kernels/test_aot_compile.py)
  [ -n "$WHEELHOUSE" ] && stage kernel_resources 300 "$PY" tools/kernel_resources.py \
        --target sm_90 --shapes tiny --json
  stage kernels 120 "$PY" tools/bench_kernels.py --tokens 64 --experts 8 --heads 2 --topk 2 \
        --latent 16 --iters 1 --warmup 0 --json
  stage layer_10b 240 "$PY" tools/bench_moe_layer.py --preset mvmoe_10b_a1b --hidden 64 \
        --latent 32 --experts 8 --topk 2 --expert-ffn 32 --tokens 32 --warmup 0 --repeats 1 --json
  stage attention 120 "$PY" tools/bench_attention.py --seq 32 --batch 1 --rounds 1 --warmup 0 \
        --json
  TRAIN_ARGS=(--train-iters 4 --save-interval 2 --lr-warmup-iters 1
              --expert-model-parallel-size 1 --global-batch-size 2 --micro-batch-size 1
              --seq-length 32)
  RESUME_AT=2 TRAIN_S=400 RESUME_S=300
}

training_data() {  # a 512-token BPE over text every checkout has (README, the package code)
  "$PY" - "$OUT/tokens" <<'PYEOF'
import glob, os, sys
import numpy as np
from tokenizers import ByteLevelBPETokenizer
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
text = "\n".join(open(p, errors="ignore").read() for p in sorted(
    glob.glob("README.md") + glob.glob("megatron_mvmoe/**/*.py", recursive=True)))
cut = int(len(text) * 0.9)
tok = ByteLevelBPETokenizer()
tok.train_from_iterator([text[:cut]], vocab_size=512, min_frequency=2,
                        special_tokens=["<|endoftext|>"])
for split, part in (("train", text[:cut]), ("valid", text[cut:])):
    np.save(os.path.join(out, f"tech_{split}.npy"), np.asarray(tok.encode(part).ids, np.int32))
PYEOF
}

train_and_resume() {  # train, save; rewind the checkpoint to RESUME_AT; resume to the end
  local common=(--config examples/tiny_cpu.yaml --data-kind tokens --data-path "$OUT/tokens"
                --vocab-size 512 --eval-iters 0 --log-interval 1 --tensorboard false
                --save "$OUT/ckpt" "${TRAIN_ARGS[@]}")
  rm -rf "$OUT/ckpt" "$OUT/train_tiny" "$OUT/train_resume"
  stage train_tiny "$TRAIN_S" "$PY" -m megatron_mvmoe.training.pretrain "${common[@]}" \
        --run-dir "$OUT/train_tiny"
  [ -d "$OUT/ckpt" ] && printf 'iter_%07d\n' "$RESUME_AT" > "$OUT/ckpt/latest"
  stage train_resume "$RESUME_S" "$PY" -m megatron_mvmoe.training.pretrain "${common[@]}" \
        --load "$OUT/ckpt" --run-dir "$OUT/train_resume"
  stage resume_check 30 "$PY" tools/gpu_check_summary.py resume "$OUT" "$RESUME_AT"
}

if [ "$MODE" = gpu ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
    echo "[gpu_check] no CUDA device: run with --cpu-smoke on CPU" >&2; exit 3; }
fi
install_wheelhouse
IMPORTS_S=90 FAST_PATHS_S=60
[ "$MODE" = cpu-smoke ] && IMPORTS_S=300 FAST_PATHS_S=240  # shared, loaded CPU cores
stage imports "$IMPORTS_S" "$PY" tools/gpu_image.py imports
if [ "$MODE" = gpu ]; then gpu_stages; else cpu_smoke_stages; fi
training_data
stage fast_paths "$FAST_PATHS_S" "$PY" tools/plan.py --config examples/configs/mvmoe_10b_a1b_64gpu.yaml \
      --fast-paths --target here --json
train_and_resume
"$PY" tools/gpu_check_summary.py summary "$OUT"
