"""torchrun with its --shutdown-timeout honoured when a worker fails:
`python -m megatron_mvmoe.launch.torchrun <torchrun's arguments>` (what
examples/launch/torchrun_local.sh runs).

In torch 2.13 --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) reaches only the agent's
signal path. When a worker fails, `SubprocessContext._poll` stops the others with
`self.close()`, whose grace is the hard-coded 30 s (and `_stop_workers` then passes 30
again; upstream pytorch/pytorch PR #192815, open, fixes only the latter). A rank that hangs
or is stopped gets that SIGTERM without acting on it, so the job ended 30 s after the
failure, not after the chosen grace (issue 25 finding 6: 42.8 s with a 10 s collective
timeout).

Design choices:
- One patch, in the launcher process only (workers never import this), applied only where
  the probe sees the bug (`_poll` still calls `self.close()` with no timeout): a
  `close()` without a timeout uses TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which main() sets from
  --shutdown-timeout, so every path uses the one grace the user chose.
- `patch_status()` says 'needed', 'applied' or 'not needed';
  tests/launch/test_torchrun_patch.py fails when a torch release fixes it (drop it then).
- It ends with the trainer's exit status (2 bad input, 3 stopped early and saved, ...):
  plain torchrun exits 1 on any worker failure and prints its 25-line ChildFailedError
  block; here the failure is one line naming the first rank that failed and its status,
  and that status (128 + n for a rank killed by signal n) is the launcher's own.
- Everything else is torchrun itself (`torch.distributed.run`).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCH_DEFAULT_S = 30
_UNBOUNDED_CLOSE = "self.close()"


def patch_status() -> str:
    if getattr(PContext.close, "_mvmoe_shutdown_timeout", False):
        return "applied"
    return ("needed" if _UNBOUNDED_CLOSE in inspect.getsource(SubprocessContext._poll)
            else "not needed")


def honour_shutdown_timeout() -> str:
    """Make `PContext.close()` without a timeout use TIMEOUT_ENV; returns patch_status()."""
    if patch_status() != "needed":
        return patch_status()
    original = PContext.close

    def close(self, death_sig=None, timeout: Optional[int] = None) -> None:
        if timeout is None:
            timeout = int(os.environ.get(TIMEOUT_ENV, TORCH_DEFAULT_S))
        original(self, death_sig, timeout)

    close._mvmoe_shutdown_timeout = True
    PContext.close = close
    return patch_status()


def exit_status(failure: ProcessFailure) -> int:
    """A worker's status as a shell reports it: its own, or 128 + n when signal n killed it."""
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


def failure_line(err: ChildFailedError) -> str:
    """The first rank that failed, in one line (the error itself is above: the trainer
    prints it once, training/error_once.py, so maybe from another rank that hit the same)."""
    rank, first = err.get_first_failure()
    how = (f"was killed by {first.signal_name()}" if first.exitcode < 0 else
           f"exited with status {first.exitcode}")
    others = len(err.failures) - 1
    rest = f" ({others} more rank(s) stopped after it)" if others else ""
    return (f"torchrun: rank {rank} (PID {first.pid} on {socket.gethostname()}) {how} "
            f"first{rest}; the error is above")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.run import parse_args, run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.shutdown_timeout is not None:
        os.environ[TIMEOUT_ENV] = str(args.shutdown_timeout)
    honour_shutdown_timeout()
    try:
        run(args)
    except ChildFailedError as err:
        sys.stdout.flush()
        sys.stderr.write(failure_line(err) + "\n")
        sys.stderr.flush()
        return exit_status(err.get_first_failure()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
