# Sourced by the pretraining recipes: `start_run` before the training step, `requeue_on_stop
# $status` after it.
# The trainer, stopped early on purpose (SIGUSR1 from `#SBATCH --signal=USR1@120`, SIGTERM,
# --exit-duration-in-mins, --exit-interval), saves a checkpoint, exits with status 3 and
# leaves $SAVE/stopped_early.json naming its run (MVMOE_RUN_ID = job id . restart count).
# Only that marker, written by THIS job's current run, requeues the job: it restarts with
# the same command line, whose `--load $SAVE` resumes from that checkpoint. A crash, or a
# stale marker of an earlier job or restart (deleted at start, and ignored by run id
# anyway), is not requeued, so a broken run cannot loop; MAX_RESTARTS bounds requeues.
# Either way megatron_mvmoe.training.job_end prints one line after all tracebacks: why the
# job ended, which rank or node failed, and the --load/--ckpt-step to resume with.
start_run() {
    export MVMOE_RUN_ID="${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}"
    rm -f "$SAVE/stopped_early.json"  # a marker of an earlier run must never requeue this one
}

requeue_on_stop() {
    local status=$1 restarts=${SLURM_RESTART_COUNT:-0} ended=0
    "${PYTHON:-python}" -m megatron_mvmoe.training.job_end --save "$SAVE" --status "$status" \
        || ended=$?
    if [ "$ended" -ne 3 ]; then  # 3: this run stopped early on purpose and saved
        return "$status"
    fi
    if [ "$restarts" -ge "${MAX_RESTARTS:-100}" ]; then
        echo "restart $restarts reached MAX_RESTARTS: not requeueing"
        return "$status"
    fi
    echo "requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
}
