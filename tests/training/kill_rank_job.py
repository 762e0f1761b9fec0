"""A training job whose rank 1 kills itself (SIGKILL), or stops itself (SIGSTOP: a hung
rank), at the step given by KILL_AT_STEP (STOP_MODE=kill|stop); the dead-rank tests launch
it under torchrun. With EXIT_TIMES_DIR set, each rank writes the wall-clock time it exits
(and rank 1 the time it stopped) there, so a test can measure how long survivors waited."""

import os
import signal
import sys
import time


def _stamp(name: str) -> None:
    folder = os.environ.get("EXIT_TIMES_DIR")
    if folder:
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(repr(time.time()))


def _on_step(step, trainer):
    if str(step) == os.environ.get("KILL_AT_STEP") and os.environ.get("RANK") == "1":
        if os.environ.get("STOP_MODE", "kill") == "stop":
            _stamp("stopped")
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from megatron_mvmoe.training import pretrain

    try:
        pretrain.run_from_args(sys.argv[1:], on_step=_on_step)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        _stamp(f"exit_rank_{os.environ.get('RANK')}")
