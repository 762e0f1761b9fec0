#!/usr/bin/env bash
# A checkpoint written under megatron-core 0.16.1 (this project before the 0.19.2 port,
# commit 2e076fd) resumes under 0.19.2, and the resumed steps match 0.16.1's own.
#
#   bash tools/resume_from_0161.sh [WORK_DIR]        # about 3 minutes on 2 cores
#
# 1. builds a Python 3.11 venv with megatron-core 0.16.1 and the pre-port checkout
#    (git worktree of OLD_COMMIT), 2. trains the tiny Multi-View model 6 steps there
#    (EP=2 under torchrun, checkpoint at step 3, dp_reshardable optimizer format),
# 3. resumes from step 3 with this checkout (0.19.2) to step 6, 4. prints both runs'
#    losses for steps 4-6 and whether they are bit-identical (JSON on the last line).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD_COMMIT=${OLD_COMMIT:-2e076fd}
WORK=${1:-runs/resume_from_0161}
PY311=${PY311:-$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.11*/bin/python3.11 2>/dev/null | tail -1)}
[ -x "${PY311:-}" ] || { echo "error: needs a Python 3.11 (megatron-core 0.16.1); set PY311" >&2; exit 2; }
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
OLD_TREE="$WORK/checkout_0161"
if [ ! -d "$OLD_TREE" ]; then
  git worktree add --detach "$OLD_TREE" "$OLD_COMMIT" >/dev/null
fi
if [ ! -x "$WORK/venv311/bin/python" ]; then
  echo "[0.16.1] venv (torch 2.13.0 CPU, megatron-core 0.16.1)"
  "$PY311" -m venv "$WORK/venv311"
  "$WORK/venv311/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING" || true
  "$WORK/venv311/bin/pip" install -q -e "$OLD_TREE" 2>&1 | grep -v "^WARNING" || true
fi
.venv/bin/python -c "import sys; sys.path.insert(0, 'tests/training'); \
from textdata import build_token_dir; build_token_dir('$WORK/tokens')"

COMMON=(--config examples/tiny_cpu.yaml --data-kind tokens --data-path "$WORK/tokens"
        --vocab-size 512 --seq-length 64 --global-batch-size 8 --micro-batch-size 2
        --train-iters 6 --lr-warmup-iters 2 --eval-iters 0 --log-interval 1
        --tensorboard false --routing-metrics false --ckpt-optimizer-format dp_reshardable)
run_torchrun() {  # python workdir run_dir extra...
  local py=$1 dir=$2 run=$3; shift 3
  (cd "$dir" && OMP_NUM_THREADS=1 "$py" -m torch.distributed.run --nproc-per-node 2 \
     --master-port "$(shuf -i 20000-40000 -n 1)" -m megatron_mvmoe.training.pretrain \
     "${COMMON[@]}" --run-dir "$run" "$@")
}
echo "[0.16.1] train 6 steps, checkpoint at step 3"
rm -rf "$WORK/ckpt" "$WORK/run_0161" "$WORK/run_0192"
run_torchrun "$WORK/venv311/bin/python" "$OLD_TREE" "$WORK/run_0161" \
  --save "$WORK/ckpt" --save-interval 3
echo "[0.19.2] resume from the 0.16.1 checkpoint at step 3, train to step 6"
run_torchrun "$PWD/.venv/bin/python" "$PWD" "$WORK/run_0192" \
  --load "$WORK/ckpt/iter_0000003" --save ""
.venv/bin/python - "$WORK" <<'PYEOF'
import json, sys
work = sys.argv[1]
def losses(run):
    out = {}
    for line in open(f"{work}/{run}/metrics.jsonl"):
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out
old, new = losses("run_0161"), losses("run_0192")
steps = sorted(s for s in new if s > 3)
result = {"steps": steps, "megatron_core_0_16_1": [old.get(s) for s in steps],
          "megatron_core_0_19_2_resumed": [new[s] for s in steps],
          "bit_identical": all(old.get(s) == new[s] for s in steps) and bool(steps)}
print(json.dumps(result))
sys.exit(0 if steps else 1)
PYEOF
