"""Each rank's own account of how it ended, for the one-line failure summary at job end.

A rank killed outright (SIGKILL, OOM killer, node loss) or hung (SIGSTOP, a wedged device)
cannot say anything, and the survivors only see a collective time out. So every rank writes
`<save>/.ranks/rank_<r>.json` when training starts (host, PID, run id, no error) and rewrites
it with its error if it fails: after the job, a rank whose record of this run still has no
error is the one that died or hung, and the ranks with errors are the ones that noticed.
megatron_mvmoe.training.job_end reads them and prints the summary after all tracebacks.

Design choices:
- Records are written only while this run holds the --save lock (save_lock.py), so a run
  refused at start-up never overwrites the records of the run that holds the directory.
- A record names its run (`run_id`, stopping.py); records of other runs are ignored, so a
  smaller rerun does not inherit a larger run's rank files.
- Imports no torch (job_end runs after the job, on a busy node).
- The error is one line (the exception's first line, shortened): the traceback itself is in
  the job's output already.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional

from megatron_mvmoe.training.stopping import run_id

REPORTS_DIR = ".ranks"
MAX_ERROR_CHARS = 240


def host_name() -> str:
    """The node's name as Slurm knows it (the namespaces of the local cluster share one
    hostname), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class RankReport:
    """One rank's record of one run."""

    rank: int
    world_size: int
    host: str
    pid: int
    run_id: Optional[str]
    started: float
    error: Optional[str] = None
    """`<ExceptionType>: <first line>`, or None while the rank has not failed."""
    failed_at: Optional[float] = None


def _path(save: str, rank: int) -> str:
    return os.path.join(save, REPORTS_DIR, f"rank_{rank:05d}.json")


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}".strip()
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 3] + "..."


@contextlib.contextmanager
def recording(save: Optional[str], rank: int, world_size: int) -> Iterator[None]:
    """Write this rank's start record, and its error if the body raises (re-raised)."""
    if save is None:
        yield
        return
    # Here, not at the top: job_end reads records without importing torch.
    from megatron_mvmoe.checkpointing.integrity import write_json_atomic

    report = RankReport(rank, world_size, host_name(), os.getpid(), run_id(), time.time())
    os.makedirs(os.path.dirname(_path(save, rank)), exist_ok=True)
    write_json_atomic(_path(save, rank), asdict(report))
    try:
        yield
    except BaseException as err:  # SystemExit from the launcher's SIGTERM included
        report.error, report.failed_at = one_line(err), time.time()
        with contextlib.suppress(OSError):  # a full disk must not hide the real error
            write_json_atomic(_path(save, rank), asdict(report))
        raise


def read_reports(save: str, this_run: Optional[str]) -> List[RankReport]:
    """The records of run `this_run` in `save`, one per rank. A rank killed between writing
    its error record and renaming it over its start record (write_json_atomic) leaves both
    (`rank_N.json` and `rank_N.json.tmp`): the one with the error counts."""
    folder = os.path.join(save, REPORTS_DIR)
    if this_run is None or not os.path.isdir(folder):
        return []
    by_rank: Dict[int, RankReport] = {}
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name)) as fh:
                report = RankReport(**json.load(fh))
        except (OSError, ValueError, TypeError):
            continue  # a record cut short by the kill
        kept = by_rank.get(report.rank)
        if report.run_id == this_run and (kept is None or kept.error is None):
            by_rank[report.rank] = report
    return [by_rank[rank] for rank in sorted(by_rank)]


def stopped_peers(save: Optional[str], rank: int) -> List[RankReport]:
    """Other ranks of this run on this host whose process is stopped (SIGSTOP: state T in
    /proc), from their start records: the ones a timed-out collective waited for."""
    if save is None or not os.path.isdir(os.path.join(save, REPORTS_DIR)):
        return []
    found = []
    for name in sorted(os.listdir(os.path.join(save, REPORTS_DIR))):
        try:
            with open(os.path.join(save, REPORTS_DIR, name)) as fh:
                report = RankReport(**json.load(fh))
        except (OSError, ValueError, TypeError):
            continue
        if (report.run_id == run_id() and report.rank != rank and report.host == host_name()
                and _process_state(report.pid) == "T"):
            found.append(report)
    return found


def _process_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
