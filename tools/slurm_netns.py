"""A real 2-node Slurm cluster on one machine: two network namespaces joined by a veth pair.

Used by `tools/slurm_local.py start --nodes 2` (and `stop`, `status`); see
docs/ENVIRONMENT.md, "A real 2-node Slurm cluster on one machine".

    node n1: netns mvmoe_n1, veth mvmoe1 10.77.12.1/24, slurmctld + slurmd n1
    node n2: netns mvmoe_n2, veth mvmoe2 10.77.12.2/24, slurmd n2

Design choices:
- Nothing in /etc changes: each slurmd runs in its own mount + UTS namespace
  (`unshare -m -u --propagation private`) with a private hosts file bind-mounted over
  /etc/hosts and hostname nI; jobs inherit both. A node's hosts file names only itself
  (gloo binds to the address its hostname resolves to), so the OTHER node's name does not
  resolve inside a job: the rendezvous must take rank 0's address from Slurm (NodeAddr).
- Its own munged, socket and key copy in the state dir (AuthInfo=socket=...), its own
  ports (SlurmctldPort 6917, SlurmdPort 6918): a one-node cluster can run beside it.
- Traffic stays inside the namespaces this tool creates; clients (sbatch, srun, scontrol)
  run in n1's namespace: `slurm_local.py exec -- sbatch ...` or the printed prefix.
- Stop kills exactly the recorded PIDs, then deletes the namespaces (the veth pair goes
  with them) and unmounts /run/netns if this tool mounted it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

NODES = ("n1", "n2")
SUBNET = "10.77.12"
PREFIX = "mvmoe"
CTLD_PORT, SLURMD_PORT = 6917, 6918
PARTITION = "local2"


def netns(node: str) -> str:
    return f"{PREFIX}_{node}"


def veth(node: str) -> str:
    return f"{PREFIX}{node[1:]}"


def address(node: str) -> str:
    return f"{SUBNET}.{node[1:]}"


def client_prefix() -> List[str]:
    """Prefix a Slurm client command with this to run it in n1's network namespace."""
    return ["nsenter", f"--net=/run/netns/{netns('n1')}"]


def _sh(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


# ---------------------------------------------------------------- network
def namespaces_exist() -> Dict[str, bool]:
    return {n: Path(f"/run/netns/{netns(n)}").exists() for n in NODES}


def is_mount_point(path: str) -> bool:
    """From /proc/self/mountinfo: os.path.ismount misses bind mounts within one file system,
    which is what `ip netns add` makes of /run/netns."""
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == path for line in fh)


def create_network() -> bool:
    """Two namespaces, loopback up, a veth pair between them. Returns whether /run/netns
    was already a mount point (so stop knows whether to unmount it)."""
    was_mounted = is_mount_point("/run/netns")
    for node in NODES:
        _sh(["ip", "netns", "add", netns(node)])
        _sh(["ip", "-n", netns(node), "link", "set", "lo", "up"])
    _sh(["ip", "link", "add", veth("n1"), "netns", netns("n1"), "type", "veth",
         "peer", "name", veth("n2"), "netns", netns("n2")])
    for node in NODES:
        _sh(["ip", "-n", netns(node), "addr", "add", f"{address(node)}/24", "dev", veth(node)])
        _sh(["ip", "-n", netns(node), "link", "set", veth(node), "up"])
    return was_mounted


def delete_network(was_mounted: bool) -> None:
    for node in NODES:
        if Path(f"/run/netns/{netns(node)}").exists():
            _sh(["ip", "netns", "del", netns(node)], check=False)
    while (not was_mounted and is_mount_point("/run/netns")
           and not os.listdir("/run/netns")):
        if _sh(["umount", "/run/netns"], check=False).returncode != 0:
            break


def veth_counters() -> Dict[str, Dict[str, int]]:
    """rx/tx bytes of each end of the veth pair (from `ip -s -j link`)."""
    counters = {}
    for node in NODES:
        out = _sh(["ip", "-n", netns(node), "-s", "-j", "link", "show", veth(node)], check=False)
        if out.returncode != 0:
            continue
        stats = json.loads(out.stdout)[0]["stats64"]
        counters[veth(node)] = {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"]}
    return counters


# ---------------------------------------------------------------- files
def paths(state_dir: Path) -> Dict[str, Path]:
    return {"conf": state_dir / "slurm.conf", "daemons": state_dir / "daemons.json",
            "ctld": state_dir / "ctld", "spool": state_dir / "spool",
            "logs": state_dir / "logs", "munge": state_dir / "munge"}


def write_files(state_dir: Path, resources: Dict[str, str]) -> None:
    p = paths(state_dir)
    for d in (p["ctld"], p["logs"], p["munge"], *(p["spool"] / n for n in NODES)):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(p["munge"], 0o700)
    key = p["munge"] / "munge.key"
    shutil.copyfile("/etc/munge/munge.key", key)
    os.chmod(key, 0o400)
    for node in NODES:
        (state_dir / f"hosts.{node}").write_text(
            f"127.0.0.1\tlocalhost\n{address(node)}\t{node}\n")
    p["conf"].write_text(slurm_conf(state_dir, resources))


def slurm_conf(state_dir: Path, res: Dict[str, str]) -> str:
    p, host = paths(state_dir), socket.gethostname()
    nodes = [f"NodeName={n} NodeAddr={address(n)} CPUs={res['CPUs']} "
             f"RealMemory={res['RealMemory']} State=UNKNOWN" for n in NODES]
    return "\n".join([
        "ClusterName=mvmoe-local2", f"SlurmctldHost={host}({address('n1')})",
        f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={p['munge'] / 'munge.socket'}",
        f"StateSaveLocation={p['ctld']}", f"SlurmdSpoolDir={p['spool']}/%n",
        f"SlurmctldPidFile={state_dir / 'slurmctld.pid'}",
        f"SlurmdPidFile={state_dir / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={p['logs'] / 'slurmctld.log'}",
        f"SlurmdLogFile={p['logs'] / 'slurmd.%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
        "ReturnToService=2", "SchedulerType=sched/backfill", "MailProg=/bin/true",
        "SlurmdTimeout=30", "KillWait=10", "MessageTimeout=10",
        *nodes,
        f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
        "State=UP",
        "",
    ])


# ---------------------------------------------------------------- daemons
def munged_cmd(state_dir: Path) -> List[str]:
    m = paths(state_dir)["munge"]
    return ["munged", "--foreground", "--force", f"--socket={m / 'munge.socket'}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}"]


def slurmctld_cmd(state_dir: Path) -> List[str]:
    return [*client_prefix(), "slurmctld", "-D", "-c", "-f", str(paths(state_dir)["conf"])]


def slurmd_cmd(state_dir: Path, node: str) -> List[str]:
    """nsenter (net) -> unshare (mount, UTS) -> sh (bind hosts, set hostname) -> exec slurmd:
    each step execs the next, so the PID recorded ends up being slurmd's own."""
    hosts, conf = state_dir / f"hosts.{node}", paths(state_dir)["conf"]
    script = (f"mount --bind {hosts} /etc/hosts && hostname {node} && "
              f"exec slurmd -D -N {node} -f {conf}")
    return ["nsenter", f"--net=/run/netns/{netns(node)}", "unshare", "-m", "-u",
            "--propagation", "private", "sh", "-c", script]


def munge_answers(state_dir: Path) -> bool:
    sock = str(paths(state_dir)["munge"] / "munge.socket")
    cred = subprocess.run(["munge", "-n", f"--socket={sock}"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge", f"--socket={sock}"], input=cred.stdout,
                          capture_output=True, timeout=10).returncode == 0


def node_states(state_dir: Path) -> Optional[Dict[str, str]]:
    """{node: state} from sinfo run in n1's namespace, or None when slurmctld is unreachable."""
    env = {**os.environ, "SLURM_CONF": str(paths(state_dir)["conf"])}
    try:
        out = subprocess.run([*client_prefix(), "sinfo", "-h", "-N", "-o", "%N %T"],
                             capture_output=True, text=True, timeout=15, env=env)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    return dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())


def wait_for(ready, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.25)
    return False
