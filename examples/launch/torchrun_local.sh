#!/bin/bash
# One node, NPROC processes under torchrun (--standalone picks a free port).
#
#   examples/launch/torchrun_local.sh                       # tools/launch_check.py --json
#   NPROC=2 examples/launch/torchrun_local.sh -m megatron_mvmoe.training.pretrain --config cfg.yaml
#
# Arguments are torchrun's program part: a script and its arguments, or -m module ...
#
# Signals: torchrun starts each worker in its own session, and its agent dies of SIGUSR1,
# so `kill -USR1 -- -<pgid>` (or Slurm's --signal=USR1 to this script) would orphan the
# workers. So this script is the one that takes SIGUSR1, SIGTERM and SIGINT (Ctrl-C): it
# runs the agent in a session of its own (setsid) and sends the signal to the workers
# (the agent's children) itself, once; the trainer finishes its step, saves and exits 3.
# torchrun's own shutdown grace (--shutdown-timeout, 30 s by default) then applies only
# to a failure (a worker died: the others get SIGTERM, then SIGKILL), where there is
# nothing left to save, so it is SHUTDOWN_TIMEOUT=5 s here; megatron_mvmoe.launch.torchrun
# is torchrun with that timeout honoured on this path too (torch 2.13 keeps 30 s there).
# The script exits with the status of the first worker that failed (2 bad input, 3 stopped
# early and saved, 128 + n killed by signal n; megatron_mvmoe.launch.torchrun returns it and
# prints one line naming that rank instead of torchrun's ChildFailedError block).
# After torchrun ends, megatron_mvmoe.training.job_end prints one line: stopped early, or
# which rank failed and why, and the --load/--ckpt-step to resume with (from the --save
# in the arguments).
set -euo pipefail

NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MVMOE_RUN_ID=${MVMOE_RUN_ID:-local.$$.$(date +%s)}
if [ $# -eq 0 ]; then set -- tools/launch_check.py --json; fi

agent=""
forward() {  # send signal $1 to the agent's children: the workers
    local stat line ppid
    for stat in /proc/[0-9]*/stat; do
        { read -r line < "$stat"; } 2>/dev/null || continue
        read -r _ ppid _ <<< "${line##*) }"  # after "pid (comm) ": state, ppid, ...
        if [ -n "$agent" ] && [ "$ppid" = "$agent" ]; then
            stat=${stat#/proc/}
            kill -s "$1" "${stat%/stat}" 2>/dev/null || true
        fi
    done
}
for sig in USR1 TERM INT; do trap "forward $sig" "$sig"; done

setsid "$PYTHON" -m megatron_mvmoe.launch.torchrun --standalone --nproc_per_node "$NPROC" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-5}" "$@" &
agent=$!
while kill -0 "$agent" 2>/dev/null; do
    wait "$agent" || true  # returns early (128 + n) whenever a trapped signal arrives
done
status=0
wait "$agent" || status=$?  # the agent's own status (bash keeps it)
trap - USR1 TERM INT
if [ "$status" -ne 0 ] && [ "$1" != tools/launch_check.py ]; then
    ended=0  # job_end exits 3 when this run stopped early on purpose (and saved)
    "$PYTHON" -m megatron_mvmoe.training.job_end --status "$status" -- "$@" || ended=$?
    if [ "$ended" -eq 3 ]; then status=3; fi
fi
exit "$status"
