"""The trainer (pretrain.main: same exit statuses) with a pause before every step
(STEP_PAUSE_S seconds, default 0.3), so a test can signal it mid-run whatever the
machine's speed; the pause changes no number. The signal tests launch it through
examples/launch/torchrun_local.sh."""

import os
import sys
import time


def _pause(step, trainer):
    time.sleep(float(os.environ.get("STEP_PAUSE_S", "0.3")))


if __name__ == "__main__":
    from megatron_mvmoe.training import pretrain

    sys.exit(pretrain.main(sys.argv[1:], on_step=_pause))
