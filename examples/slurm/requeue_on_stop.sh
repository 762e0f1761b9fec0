# Sourced by the pretraining recipes after the training step ends (status in $1).
# The trainer, stopped early on purpose (SIGUSR1 from `#SBATCH --signal=USR1@120`, SIGTERM,
# --exit-duration-in-mins, --exit-interval), saves a checkpoint, exits with status 3 and
# leaves $SAVE/stopped_early.json. Then requeue this job: it restarts with the same command
# line, whose `--load $SAVE` resumes from that checkpoint. A crash (no marker) is not
# requeued, so a broken run cannot loop; MAX_RESTARTS bounds the number of requeues.
requeue_on_stop() {
    local status=$1 restarts=${SLURM_RESTART_COUNT:-0}
    if [ -f "$SAVE/stopped_early.json" ]; then
        if [ "$restarts" -ge "${MAX_RESTARTS:-100}" ]; then
            echo "stopped early, but restart $restarts reached MAX_RESTARTS: not requeueing"
            return "$status"
        fi
        echo "stopped early ($(cat "$SAVE/stopped_early.json")): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$status"
}
