#!/usr/bin/env bash
# The real-width 10B-A1B slice runs of issue 21 item 1, each uninterrupted (20 steps, saves at
# 10 and 20) and then resumed from its step-10 checkpoint, with the console kept beside the run
# for tools/slices_report.py. Usage: scripts/run_slices.sh NAME [NAME ...]
# (NAME = {mv,lat,mr}_{ep2,pp2}; commands come from tools/slices_report.command so the page
# prints exactly what ran). Needs data/main_job (made by `make run`). Each PP2 run takes about
# 23 GB over its 4 ranks: run nothing else meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PATH="$PWD/.venv/bin:$PATH"
mkdir -p runs/slices
for name in "$@"; do
  for resume in 0 1; do
    flag=""; suffix=""
    if [ "$resume" = 1 ]; then flag="--resume"; suffix="_resume"; fi
    cmd=$(python tools/slices_report.py --print-command "$name" $flag)
    log="runs/slices/${name}${suffix}.log"
    echo "[slices] $cmd  > $log"
    start=$(date +%s); rc=0
    env bash -c "$cmd" > "$log" 2>&1 || rc=$?
    echo "rc=$rc wall_s=$(( $(date +%s) - start )) try=1" >> "$log"
    tail -n 2 "$log"
    [ "$rc" = 0 ] || exit "$rc"
    ckpt="runs/slices/$name/checkpoints/iter_0000010"
    [ "$resume" = 1 ] || du -sb "$ckpt" > "runs/slices/$name.ckpt_size"
  done
done
