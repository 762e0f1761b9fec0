"""A training job whose rank 1 kills itself (SIGKILL) at the step given by KILL_AT_STEP:
the dead-rank test launches it under torchrun."""

import os
import signal
import sys

from megatron_mvmoe.training.pretrain import main


def _on_step(step, trainer):
    if str(step) == os.environ.get("KILL_AT_STEP") and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from megatron_mvmoe.training import pretrain

    try:
        pretrain.run_from_args(sys.argv[1:], on_step=_on_step)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
