"""The one-node Slurm cluster on localhost (root, no systemd): munged, slurmctld and slurmd
on this host, its node named by the hostname.

Design choices (examples/slurm/README.md shows it in use):
- Every file lives in one state dir (default /tmp/mvmoe_slurm): slurm.conf, spool,
  state, logs and `daemons.json`, the PIDs this module started. `stop` signals exactly
  those PIDs (after checking each still runs the program it started), never by name.
- Idempotent: `start` on a healthy cluster reports it and starts nothing; a
  half-dead one is stopped and started again. `stop` with nothing running is a no-op.
  A munged someone else started (its socket answers) is reused and left alone.
- The node is this host: NodeName = hostname, NodeAddr = 127.0.0.1, CPUs/RealMemory
  from `slurmd -C`; proctrack/linuxproc and task/none need no cgroups; accounting off;
  select/cons_tres with CR_CPU so jobs need not request memory.
- Daemons run in the foreground (-D / -F) in their own session, so the PID recorded
  is the daemon's own, and they outlive this command.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Dict, Optional

from megatron_mvmoe.dev_cluster.processes import (DevClusterError, client_env, kill,
                                                  node_resources, read_record, record_path,
                                                  require_tools, runs, spawn, wait_for,
                                                  write_record)

DEFAULT_STATE_DIR = Path(os.environ.get("MVMOE_SLURM_STATE", "/tmp/mvmoe_slurm"))
DAEMONS = ("munged", "slurmctld", "slurmd")
"""Start order; stop goes in reverse."""
MUNGE_DIRS = ("/run/munge", "/var/lib/munge", "/var/log/munge")
PARTITION = "local"


def _paths(state_dir: Path) -> Dict[str, Path]:
    return {"conf": state_dir / "slurm.conf", "ctld": state_dir / "ctld",
            "spool": state_dir / "spool", "logs": state_dir / "logs"}


def _wait(ready, timeout_s: float, what: str, log: str) -> None:
    if not wait_for(ready, timeout_s):
        raise DevClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}; see {log}")


# ---------------------------------------------------------------- munge
def _munge_answers() -> bool:
    """A munged serves the default socket: encode and decode one credential."""
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10).returncode == 0


def _start_munge(logs: Path) -> Optional[int]:
    """Reuse a running munged, else start one as user munge. Returns our PID or None."""
    if _munge_answers():
        return None
    if not Path("/etc/munge/munge.key").exists():
        raise DevClusterError("/etc/munge/munge.key is missing: run `mungekey --create` as root "
                              "(Debian's munge package creates it on install)")
    munge = pwd.getpwnam("munge")
    for d in MUNGE_DIRS:
        os.makedirs(d, exist_ok=True)
        os.chown(d, munge.pw_uid, munge.pw_gid)
        os.chmod(d, 0o755 if d == "/run/munge" else 0o700)
    pid = spawn(["munged", "--foreground"], logs / "munged.out", user="munge")
    _wait(_munge_answers, 20.0, "munged to answer on /run/munge/munge.socket.2",
          "/var/log/munge/munged.log")
    return pid


# ---------------------------------------------------------------- slurm
def _slurm_conf(state_dir: Path, host: str) -> str:
    p, res = _paths(state_dir), node_resources()
    return "\n".join([
        "ClusterName=mvmoe-local",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"StateSaveLocation={p['ctld']}", f"SlurmdSpoolDir={p['spool']}",
        f"SlurmctldPidFile={state_dir / 'slurmctld.pid'}", f"SlurmdPidFile={state_dir / 'slurmd.pid'}",
        f"SlurmctldLogFile={p['logs'] / 'slurmctld.log'}", f"SlurmdLogFile={p['logs'] / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
        "ReturnToService=2", "SchedulerType=sched/backfill", "MailProg=/bin/true",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={res['CPUs']} RealMemory={res['RealMemory']} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _node_state(state_dir: Path) -> Optional[str]:
    """The node's state as sinfo reports it ('idle', 'mixed', ...), or None if unreachable."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                             timeout=10, env=client_env(_paths(state_dir)["conf"]))
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip().lower() or None if out.returncode == 0 else None


# ---------------------------------------------------------------- commands
def status(state_dir: Path = DEFAULT_STATE_DIR) -> Dict[str, object]:
    pids = read_record(state_dir)
    alive = {name: runs(pid, name) for name, pid in pids.items() if pid}
    # sinfo blocks for its message timeout (~10 s) when no slurmctld listens: ask only ours
    node_state = _node_state(state_dir) if alive.get("slurmctld") else None
    running = bool(pids) and all(alive.values()) and node_state is not None
    return {"running": running, "state_dir": str(state_dir), "slurm_conf": str(_paths(state_dir)["conf"]),
            "pids": pids, "alive": alive, "node": socket.gethostname(), "node_state": node_state,
            "partition": PARTITION, "env": {"SLURM_CONF": str(_paths(state_dir)["conf"])}}


def stop(state_dir: Path = DEFAULT_STATE_DIR) -> Dict[str, object]:
    """Kill the daemons `start` recorded, in reverse start order."""
    pids = read_record(state_dir)
    for name in reversed(DAEMONS):
        if pids.get(name):
            kill(pids[name], name)
    record_path(state_dir).unlink(missing_ok=True)
    return {**status(state_dir), "stopped": {k: v for k, v in pids.items() if v}}


def start(state_dir: Path = DEFAULT_STATE_DIR, timeout_s: float = 60.0) -> Dict[str, object]:
    """Bring the cluster up (or report the one already up) and wait until the node is idle."""
    require_tools()
    current = status(state_dir)
    if current["running"]:
        return {**current, "already_running": True}
    stop(state_dir)  # a half-dead cluster from an earlier run
    p, host = _paths(state_dir), socket.gethostname()
    for d in (p["ctld"], p["spool"], p["logs"]):
        d.mkdir(parents=True, exist_ok=True)
    p["conf"].write_text(_slurm_conf(state_dir, host))
    pids: Dict[str, Optional[int]] = {}
    try:
        pids["munged"] = _start_munge(p["logs"])
        write_record(state_dir, pids)
        pids["slurmctld"] = spawn(["slurmctld", "-D", "-c", "-f", str(p["conf"])], p["logs"] / "slurmctld.out")
        write_record(state_dir, pids)
        pids["slurmd"] = spawn(["slurmd", "-D", "-f", str(p["conf"])], p["logs"] / "slurmd.out")
        write_record(state_dir, pids)
        _wait(lambda: _node_state(state_dir) == "idle", timeout_s,
              f"node {host} to be idle in sinfo", str(p["logs"]))
    except BaseException:
        stop(state_dir)
        raise
    return {**status(state_dir), "already_running": False}
