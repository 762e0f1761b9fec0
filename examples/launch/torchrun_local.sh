#!/bin/bash
# One node, NPROC processes under torchrun (--standalone picks a free port).
#
#   examples/launch/torchrun_local.sh                       # tools/launch_check.py --json
#   NPROC=2 examples/launch/torchrun_local.sh -m megatron_mvmoe.training.pretrain --config cfg.yaml
#
# Arguments are torchrun's program part: a script and its arguments, or -m module ...
set -euo pipefail

NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ $# -eq 0 ]; then set -- tools/launch_check.py --json; fi

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "$@"
