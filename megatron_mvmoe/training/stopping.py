"""When a run stops early on purpose: preemption signals, a wall-clock budget, a step interval.

Design choices:
- SIGTERM (Slurm preemption, scancel, time limit), SIGUSR1 (`#SBATCH --signal=USR1@120`) and
  SIGINT (Ctrl-C) only set a flag: the step in progress finishes, the loop saves and the
  process exits with EXIT_REQUEUE; rank 0 leaves STOPPED_MARKER in the save dir, which the
  sbatch recipes turn into `scontrol requeue` (torchrun reports any non-zero worker status
  as 1, so the recipes read the marker, not the status).
- The marker names the run that wrote it (`run_id`: MVMOE_RUN_ID, which the recipes set to
  `<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>`), and only a marker of this very run requeues
  (megatron_mvmoe.training.job_end): a marker left by an earlier job or an earlier restart
  (e.g. a `scancel` that saved, then a relaunch that fails on a flag) is stale, so a crash
  can never requeue. The recipes also delete it before launching.
- A second SIGINT (Ctrl-C twice) exits at once (SystemExit: `finally` blocks still run).
  Repeated SIGTERM/SIGUSR1 are only noted: under torchrun a worker gets Slurm's SIGTERM
  and then torchrun's copy of it, and must still save.
- Ranks decide together: the local flags ride in the one all-reduce per step that also
  checks the loss and gradient norm (step.py), so every rank stops after the same step
  even when the signal reached only some of them (or their clocks differ).
- A worker never outlives its launcher: a process started by a launcher (torchrun, srun,
  mpirun) remembers its parent and checks at every step whether it still has it. torchrun
  starts each worker in its own session and its agent dies of SIGUSR1, so a plain
  `torchrun ...` with `kill -USR1 -- -<pgid>` used to leave the workers training on as
  orphans of PID 1; now the agent's death is a stop reason like a signal: every rank
  saves after the step and exits with EXIT_REQUEUE. A getppid() per step costs nothing
  and needs no thread or prctl (PR_SET_PDEATHSIG fires when the forking *thread* ends).
- `--exit-interval` is a pure function of the step; `--exit-duration-in-mins` counts from
  the construction of StopConditions (the start of `pretrain`), as Megatron-LM does.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

EXIT_REQUEUE = 3
"""Process exit status after a deliberate early stop with a checkpoint saved: requeue me."""
EXIT_USER_ERROR = 2
"""Process exit status for a bad config, a bad checkpoint or a NaN/inf stop."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOPPED_MARKER = "stopped_early.json"
"""In the save dir while the newest checkpoint is from a deliberate early stop."""
RUN_ID_ENV = "MVMOE_RUN_ID"


def run_id(env=None) -> Optional[str]:
    """This launch's identity: MVMOE_RUN_ID, else `<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>` under
    Slurm (a requeued job keeps its id and counts restarts), else None."""
    env = os.environ if env is None else env
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]
    if env.get("SLURM_JOB_ID"):
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT') or 0}"
    return None


def launcher_pid(env=None) -> Optional[int]:
    """This rank's parent when a launcher (torchrun, srun, mpirun) started it: the rank stops
    and saves once that parent is gone. None for a plain `python -m ...`, whose parent is a
    shell that may end (nohup) without meaning "stop"."""
    from megatron_mvmoe.launch.rendezvous import detect_launcher  # here: job_end needs no torch

    return None if detect_launcher(os.environ if env is None else env) == "single" else \
        os.getppid()


def marker_payload(step: int, reason: str, checkpoint: Optional[str]) -> Dict[str, object]:
    """What STOPPED_MARKER holds; `run_id` ties it to the run that stopped."""
    return {"step": step, "reason": reason, "checkpoint": checkpoint,
            "exit_status": EXIT_REQUEUE, "run_id": run_id()}


@dataclass
class StopFlags:
    """This rank's reasons to stop after the current step, as numbers for a MAX reduction."""

    signal: float = 0.0
    """The signal number received (0: none)."""
    time_up: float = 0.0
    """1.0 once the --exit-duration-in-mins budget is spent."""
    launcher_gone: float = 0.0
    """1.0 once the process that launched this rank has exited (we were re-parented)."""

    def as_list(self) -> List[float]:
        return [self.signal, self.time_up, self.launcher_gone]


class StopConditions:
    """Signal handlers plus the time budget; `install` in the main thread, `restore` after."""

    def __init__(self, exit_duration_in_mins: Optional[float], exit_interval: Optional[int],
                 launcher_pid: Optional[int] = None):
        """launcher_pid: the parent to outlive no longer than a step (None: not watched)."""
        self.launcher_pid = launcher_pid
        self.exit_duration_s = None if exit_duration_in_mins is None else exit_duration_in_mins * 60
        self.exit_interval = exit_interval
        self.start = time.monotonic()
        self.received: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise SystemExit(f"second signal {signal.Signals(signum).name}: exiting without "
                             "saving (the first one asked for a save after the current step)")
        if self.received is not None:
            return
        self.received = signum
        print(f"received {signal.Signals(signum).name}: saving after the current step, then "
              f"exiting with status {EXIT_REQUEUE}", flush=True)

    def local_flags(self) -> StopFlags:
        time_up = (self.exit_duration_s is not None and
                   time.monotonic() - self.start >= self.exit_duration_s)
        return StopFlags(signal=float(self.received or 0), time_up=float(time_up),
                         launcher_gone=float(self._launcher_gone()))

    def _launcher_gone(self) -> bool:
        return self.launcher_pid is not None and os.getppid() != self.launcher_pid

    def reason(self, step: int, reduced: StopFlags) -> Optional[str]:
        """Why the run stops after `step` (the same on every rank), or None to go on."""
        if reduced.signal:  # the largest signal number any rank received
            return f"{signal.Signals(int(reduced.signal)).name} received"
        if reduced.launcher_gone:
            return ("the launcher exited (this rank's parent process is gone; e.g. torchrun's "
                    "agent killed by a signal sent to its process group)")
        if reduced.time_up:
            return f"--exit-duration-in-mins {self.exit_duration_s / 60:g} reached"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached at step {step}"
        return None


def exit_cleanly_on_sigterm() -> None:
    """torchrun (and Slurm) stop surviving ranks with SIGTERM when one rank dies. Turning
    it into SystemExit runs the `finally` blocks, which stop the checkpoint writer's helper
    process; killed outright, that helper outlives the rank and holds its stdout open."""
    def handler(signum, frame):
        raise SystemExit(f"rank stopped by signal {signum} (another rank failed or the "
                         "launcher is shutting the job down)")

    signal.signal(signal.SIGTERM, handler)
