"""One writer per --save directory: an exclusive lock held by rank 0 for the whole run.

Two trainings on one --save (a copy-pasted sbatch line, a requeue while the previous
allocation is still dying) would interleave iter_* directories and the `latest` pointer,
and the second one's start-up would delete the first one's half-written save. So the
second one is refused at start-up, before anything is built, with one line naming the
holder (host, Slurm job, PID, since when).

Design choices:
- The lock is `fcntl.flock` on `<save>/.save.lock`, a file in the shared directory, not a
  PID check: the kernel (for NFS, the lock server) drops the lock when the holding process
  dies, on whatever node it ran, so a lock file left by a crashed run is stale by
  construction and the next run takes it over (saying whose it was). Our 2-node cluster's
  nodes share one kernel and file system; NFSv4 and Lustre mounted with `-o flock` do the
  same across machines (NFS drops a dead client's locks when its lease expires).
- The file also holds the holder's identity (JSON), only for the refusal message and the
  takeover note. A clean exit unlinks it while still holding the lock; an acquirer checks
  that the file it locked is still the one at the path (inode), so an unlink racing with
  an acquire cannot hand the lock to two runs.
- Where flock is unsupported (ENOLCK, EOPNOTSUPP: e.g. Lustre without `-o flock`), the lock
  is the file's existence (O_EXCL), and a holder counts as gone only when that is certain:
  on this host, its PID is not alive; on any host, it is an earlier restart of this very
  Slurm job (Slurm starts a requeued job only once its previous allocation has ended).
  Any other host's lock must be removed by hand, and the refusal says so.
- Every rank learns rank 0's verdict (a broadcast), so all ranks raise the same error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch.distributed as dist

from megatron_mvmoe.errors import require
from megatron_mvmoe.training.rank_reports import host_name
from megatron_mvmoe.training.stopping import run_id

LOCK_NAME = ".save.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@dataclass
class Holder:
    """Who holds a --save directory."""

    host: str
    pid: int
    job: Optional[str]
    """SLURM_JOB_ID, or None outside Slurm."""
    run_id: Optional[str]
    since: str

    @classmethod
    def me(cls) -> "Holder":
        return cls(host_name(), os.getpid(), os.environ.get("SLURM_JOB_ID"), run_id(),
                   time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    @classmethod
    def parse(cls, text: str) -> Optional["Holder"]:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None  # empty (being written) or not ours

    def describe(self) -> str:
        job = f"job {self.job}" if self.job else "no Slurm job"
        return f"host {self.host}, {job}, PID {self.pid}, since {self.since}"

    def surely_gone(self) -> bool:
        """True only when the holder certainly ended (the no-flock rule above)."""
        me = Holder.me()
        if self.job is not None and self.job == me.job and self.run_id != me.run_id:
            return True  # an earlier restart of this job
        if self.host != me.host:
            return False  # cannot tell from here
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _read(path: str) -> Optional[Holder]:
    try:
        with open(path) as fh:
            return Holder.parse(fh.read())
    except OSError:
        return None


def _refuse(save: str, path: str, holder: Optional[Holder], by_hand: bool) -> None:
    who = holder.describe() if holder else "a run whose details are not written yet"
    fix = "wait for it to end, stop it"
    if holder and holder.job:
        fix += f" (scancel {holder.job})"
    elif holder:
        fix += f" (kill {holder.pid} on {holder.host})"
    fix += ", or pass another --save"
    if by_hand:
        fix += f"; if that run is gone, delete {path} (this file system has no flock)"
    require(False, "--save", f"{save} is in use by another training ({who}); two runs "
            "writing one directory would interleave checkpoints and `latest`", fix)


class SaveLock:
    """A held lock; `release()` unlinks the file, then drops the lock."""

    def __init__(self, path: str, fd: Optional[int], previous: Optional[Holder]):
        self.path, self._fd, self.previous = path, fd, previous

    @classmethod
    def acquire(cls, save: str) -> "SaveLock":
        """Take the lock or raise ValueError naming the holder. `previous` is the holder
        of a stale lock this call took over."""
        os.makedirs(save, exist_ok=True)
        path = os.path.join(save, LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                _refuse(save, path, _read(path), by_hand=False)
            except OSError as err:
                os.close(fd)
                if err.errno not in _NO_FLOCK:
                    raise
                return cls._acquire_by_existence(save, path)
            if _same_file(fd, path):
                break
            os.close(fd)  # unlinked by a releasing holder after we opened it: retry
        previous = _read(path)
        _write(fd, Holder.me())
        return cls(path, fd, previous)

    @classmethod
    def _acquire_by_existence(cls, save: str, path: str) -> "SaveLock":
        previous = None
        for _ in range(2):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(path)
                if holder is None or not holder.surely_gone():
                    _refuse(save, path, holder, by_hand=True)
                previous = holder
                os.unlink(path)
                continue
            _write(fd, Holder.me())
            os.close(fd)
            return cls(path, None, previous)
        _refuse(save, path, _read(path), by_hand=True)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # still locked: nobody can take the old inode meanwhile
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _write(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
    os.fsync(fd)


@contextlib.contextmanager
def hold_save_lock(save: Optional[str]) -> Iterator[Optional[SaveLock]]:
    """Rank 0 holds the lock of `save` for the body (nothing without --save); every rank
    raises the same ValueError when another run holds it."""
    if save is None:
        yield None
        return
    lock, verdict = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = SaveLock.acquire(save)
            if lock.previous is not None:
                print(f"--save {save}: took over the lock of a run that ended without "
                      f"releasing it ({lock.previous.describe()})", flush=True)
        except ValueError as err:
            verdict = [str(err)]
        except OSError as err:  # e.g. read-only: every rank must hear it, not wait for it
            verdict = [f"--save: cannot take the lock {os.path.join(save, LOCK_NAME)} "
                       f"({err.strerror}). Fix: pass a --save directory this job can write"]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
