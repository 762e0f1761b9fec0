#!/usr/bin/env bash
# GPU check: everything that needs a GPU, in one go (<= 8 minutes on one H100/H200).
#
#   bash tools/gpu_check.sh                 # on a GPU machine; results in $OUT or runs/gpu_check
#   bash tools/gpu_check.sh --cpu-smoke     # same stages, tiny sizes, on CPU (tests use this)
#
# Stages (each bounded by `timeout`; a failing stage is recorded and the next one runs):
#   1. the `gpu`-marked tests (compiled Triton kernels against their torch references, ...)
#   2. tools/kernel_resources.py (AOT compile for sm_90/sm_100, registers/spills; GPU mode)
#      and tools/bench_kernels.py: fused routing and mix+permute kernels vs references
#   3. tools/bench_moe_layer.py --preset mvmoe_10b_a1b: one 10B-A1B MoE layer at real size,
#      forward + backward per variant (latent baseline, Multi-Router, Multi-View) with the
#      GPU fast paths: achieved TFLOP/s, peak memory, MV/baseline time ratio
#   3b. tools/bench_attention.py: the core attention on torch SDPA vs Megatron's unfused one
#      (no TransformerEngine on the image): which aten SDPA kernel ran (flash / efficient /
#      cudnn / math), torch.backends.cuda's switches, TFLOP/s of each, the time ratio
#   4. tools/plan.py --fast-paths --target here: which fast path this machine takes
#   5. 20 training steps of the tiny Multi-View model through the whole stack (TE specs,
#      grouped experts, bf16, overlapped DDP) on one GPU
# Then $OUT/summary.json: each stage's exit status and seconds, and the layer figures.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = "--cpu-smoke" ] && MODE=cpu-smoke
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
mkdir -p "$OUT"
STATUS="$OUT/stages.tsv"
: > "$STATUS"

stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "[gpu_check] $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$STATUS"
  echo "[gpu_check] $name: exit $rc in $((SECONDS - start)) s"
}

if [ "$MODE" = gpu ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
    echo "[gpu_check] no CUDA device: run with --cpu-smoke on CPU" >&2; exit 3; }
  stage gpu_tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
  stage kernel_resources 120 "$PY" tools/kernel_resources.py --json  # AOT sm_90/sm_100 compiles
  stage kernels 90 "$PY" tools/bench_kernels.py --tokens 16384 --experts 160 --heads 2 \
        --topk 8 --dtype bf16 --json
  stage layer_10b 150 "$PY" tools/bench_moe_layer.py --preset mvmoe_10b_a1b --dtype bf16 \
        --tokens 16384 --warmup 3 --repeats 10 --json
  stage attention 90 "$PY" tools/bench_attention.py --dtype bf16 --clock wall --heads 16 \
        --head-dim 128 --seq 4096 --batch 2 --rounds 10 --json
  TRAIN_ARGS=(--train-iters 20 --lr-warmup-iters 2 --expert-model-parallel-size 1 --precision bf16)
else
  stage gpu_tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider --collect-only tests
  stage kernels 120 "$PY" tools/bench_kernels.py --tokens 64 --experts 8 --heads 2 --topk 2 \
        --latent 16 --iters 1 --warmup 0 --json
  stage layer_10b 240 "$PY" tools/bench_moe_layer.py --preset mvmoe_10b_a1b --hidden 64 \
        --latent 32 --experts 8 --topk 2 --expert-ffn 32 --tokens 32 --warmup 0 --repeats 1 --json
  stage attention 120 "$PY" tools/bench_attention.py --seq 32 --batch 1 --rounds 1 --warmup 0 \
        --json
  TRAIN_ARGS=(--train-iters 2 --lr-warmup-iters 1 --expert-model-parallel-size 1 --global-batch-size 2
              --micro-batch-size 1 --seq-length 32)
fi
# Training data for stage 5 from text every checkout has (the repository's own docs and
# code), so the GPU machine needs no corpus build: a 512-token BPE, `tokens` data kind.
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
stage fast_paths 60 "$PY" tools/plan.py --config examples/configs/mvmoe_10b_a1b_64gpu.yaml \
      --fast-paths --target here --json
stage train_tiny 240 "$PY" -m megatron_mvmoe.training.pretrain --config examples/tiny_cpu.yaml \
      --data-kind tokens --data-path "$OUT/tokens" --vocab-size 512 --save "" --eval-iters 0 \
      --run-dir "$OUT/train_tiny" \
      --tensorboard false "${TRAIN_ARGS[@]}"

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
stages = {}
for line in (out / "stages.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    stages[name] = {"exit": int(rc), "seconds": int(seconds)}
summary = {"stages": stages}
try:
    layer = json.loads((out / "layer_10b.out").read_text())
    summary["layer_10b"] = {v: {k: r[k] for k in ("median_s", "achieved_tflops", "memory_bytes",
                                                 "time_ratio", "flop_ratio")}
                            for v, r in layer["variants"].items()}
    summary["mv_over_baseline_time"] = layer["variants"]["multi_view"]["time_ratio"]
except (OSError, ValueError, KeyError) as err:
    summary["layer_10b"] = f"unavailable: {err}"
try:
    attention = json.loads((out / "attention.out").read_text())
    summary["attention"] = {k: attention[k] for k in ("sdpa_kernels", "sdpa_switches",
                                                      "tflops", "sdpa_over_unfused")}
except (OSError, ValueError, KeyError) as err:
    summary["attention"] = f"unavailable: {err}"
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
sys.exit(0 if all(s["exit"] == 0 for s in stages.values()) else 1)
PYEOF
