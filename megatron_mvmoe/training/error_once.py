"""A user error of a multi-rank run, printed once, on a line of its own, with the rank.

Design choices:
- Every rank of a launch parses the same arguments and files, so a config error is raised
  by all of them: only rank 0 prints it (`config_error`).
- Later errors may be the same on every rank (a bad checkpoint, a NaN stop decided
  together) or one rank's own. While the process group exists, the first rank to fail
  stores `rank<TAB>message` under one key of torch.distributed's store (one compare-set,
  no collective: the other ranks may be blocked in one); a rank whose message is the
  stored one stays silent, a different error is printed with its own rank. Without a
  store (a single process, or the store gone) the rank prints.
- One os.write per line (atomic on a pipe below PIPE_BUF), after flushing stdout, so the
  line is never glued to another process's or our own partial output.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

FIRST_ERROR_KEY = "mvmoe/first_error"


def _rank() -> Optional[int]:
    rank = os.environ.get("RANK", "").strip()
    return int(rank) if rank.isdigit() else None


def default_store():
    """torch.distributed's default store while the process group exists, else None."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def write_line(text: str) -> None:
    """`text` as one line of stderr, in one write."""
    line = "\n".join(text.splitlines()) + "\n"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (pytest's capsys)
        sys.stderr.write(line)
        return
    os.write(fd, line.encode("utf-8", "backslashreplace"))


def config_error(err: Exception) -> None:
    """An argument or config-file error: the same on every rank, so rank 0 prints it."""
    if _rank() in (None, 0):
        write_line(f"error: {err}")


def rank_error(err: Exception, store=None) -> None:
    """An error raised after start-up: printed by the first rank that raised it, and by any
    rank whose error differs; `store` is torch.distributed's default store, or None."""
    rank, message = _rank(), str(err)
    if rank is not None and store is not None and not _first_with(store, rank, message):
        return
    write_line(f"error (rank {rank}): {message}" if rank is not None else f"error: {message}")


def _first_with(store, rank: int, message: str) -> bool:
    """True unless another rank already stored this very message."""
    ours = f"{rank}\t{message}"
    try:
        stored = store.compare_set(FIRST_ERROR_KEY, "", ours)
    except Exception:  # the store's host is gone: print rather than lose the error
        return True
    stored = stored.decode("utf-8", "replace") if isinstance(stored, bytes) else str(stored)
    return stored == ours or stored.split("\t", 1)[-1] != message


class CollectiveTimeout(RuntimeError):
    """A collective waited parallel.distributed_timeout_seconds for a rank that never came."""


def is_collective_timeout(err: BaseException) -> bool:
    """gloo's "Timed out waiting 10000ms for recv operation to complete" and its kin."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def collective_timeout(err: BaseException, timeout_s: float, save: Optional[str],
                       rank: int) -> CollectiveTimeout:
    """One line for the 200-line gloo traceback: the timeout and, when a rank on this host
    is stopped, which one (rank_reports' start records give its PID)."""
    from megatron_mvmoe.training.rank_reports import stopped_peers

    stopped = stopped_peers(save, rank)
    who = (", ".join(f"rank {r.rank} (PID {r.pid} on {r.host}) is stopped (SIGSTOP)"
                     for r in stopped) if stopped else
           "another rank stopped responding (hung, stopped or killed; the launcher's "
           "output or <save>/.ranks/ names it)")
    first = (str(err).strip().splitlines() or [""])[0]
    return CollectiveTimeout(
        f"a collective timed out after {timeout_s:g} s (parallel.distributed_timeout_seconds):"
        f" {who} [{first[-120:]}]. Fix: resume that rank's job (kill -CONT) or restart from "
        "the last checkpoint; raise --distributed-timeout-seconds if a step legitimately "
        "takes longer")
