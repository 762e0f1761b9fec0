"""The trainer (pretrain.main: same exit statuses) with a pause before every step
(STEP_PAUSE_S seconds, default 0.3), so a test can signal it mid-run whatever the
machine's speed; the pause changes no number. The signal tests launch it through
examples/launch/torchrun_local.sh. With STOP_RANK_1_AT_STEP=N, rank 1 stops itself
(SIGSTOP: a hung rank) before step N."""

import os
import signal
import sys
import time


def _pause(step, trainer):
    if os.environ.get("RANK") == "1" and str(step) == os.environ.get("STOP_RANK_1_AT_STEP"):
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(float(os.environ.get("STEP_PAUSE_S", "0.3")))


if __name__ == "__main__":
    from megatron_mvmoe.training import pretrain

    sys.exit(pretrain.main(sys.argv[1:], on_step=_pause))
