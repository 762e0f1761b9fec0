"""Processes by PID, the recorded-daemons file and the checks every dev cluster shares.

Daemons are signalled only by the PID recorded when they were started, after checking the PID
still runs the program it started (PIDs get reused), never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional


class DevClusterError(RuntimeError):
    """A step of start/stop failed; the message says which and where the log is."""


# ---------------------------------------------------------------- processes by PID
def proc_state(pid: int) -> Optional[str]:
    """Single-letter state from /proc/<pid>/stat, or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def runs(pid: Optional[int], program: str) -> bool:
    """True if pid is alive (not a zombie) and still runs `program` (PIDs get reused)."""
    if not pid or proc_state(pid) in (None, "Z", "X"):
        return False
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm == program[:15]


def kill(pid: int, program: str, grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL; only if pid still runs program."""
    if not runs(pid, program):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not runs(pid, program):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def spawn(cmd: List[str], log: Path, user: Optional[str] = None) -> int:
    """Start a foreground daemon detached from this process; return its PID."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, user=user)
    return proc.pid


# ---------------------------------------------------------------- waiting
def wait_for(ready, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.25)
    return False


# ---------------------------------------------------------------- recorded daemons
def record_path(state_dir: Path) -> Path:
    return state_dir / "daemons.json"


def read_record(state_dir: Path) -> Dict[str, object]:
    """What `start` recorded in the state dir (daemon PIDs and facts), {} when nothing."""
    try:
        return json.loads(record_path(state_dir).read_text())
    except (OSError, ValueError):
        return {}


def write_record(state_dir: Path, record: Dict[str, object]) -> None:
    record_path(state_dir).write_text(json.dumps(record))


def client_env(conf: Path) -> Dict[str, str]:
    """This environment with SLURM_CONF pointing at the cluster's slurm.conf."""
    return {**os.environ, "SLURM_CONF": str(conf)}


# ---------------------------------------------------------------- host checks
def require_tools() -> None:
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sinfo") if not shutil.which(t)]
    if missing:
        raise DevClusterError(f"not installed: {', '.join(missing)}. Fix: apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        raise DevClusterError("must run as root (the daemons run as root and munged as user munge)")


def node_resources() -> Dict[str, str]:
    """CPUs and RealMemory as `slurmd -C` reports them for this host."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return {"CPUs": fields["CPUs"], "RealMemory": fields["RealMemory"]}
