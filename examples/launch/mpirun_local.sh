#!/bin/bash
# One node, NPROC processes under Open MPI's mpirun, traffic kept on loopback. Ranks come
# from OMPI_COMM_WORLD_*; rank 0 broadcasts its host and a free port with mpi4py
# (megatron_mvmoe.launch.mpi), or export MASTER_ADDR/MASTER_PORT to skip that.
#
#   examples/launch/mpirun_local.sh                         # tools/launch_check.py --json
#   NPROC=2 examples/launch/mpirun_local.sh -m megatron_mvmoe.training.pretrain --config cfg.yaml
#
# Arguments are what python runs: a script and its arguments, or -m module ...
set -euo pipefail

NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ $# -eq 0 ]; then set -- tools/launch_check.py --json; fi

exec mpirun --allow-run-as-root --oversubscribe --bind-to none \
    --mca oob_tcp_if_include lo --mca btl self,vader \
    -np "$NPROC" "$PYTHON" "$@"
