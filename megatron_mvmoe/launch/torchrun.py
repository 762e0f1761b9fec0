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
- Everything else is torchrun itself (`torch.distributed.run`).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

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


def main(argv: Optional[Sequence[str]] = None) -> None:
    from torch.distributed.run import main as torchrun_main
    from torch.distributed.run import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    timeout = parse_args(argv).shutdown_timeout
    if timeout is not None:
        os.environ[TIMEOUT_ENV] = str(timeout)
    honour_shutdown_timeout()
    torchrun_main(argv)


if __name__ == "__main__":
    main()
