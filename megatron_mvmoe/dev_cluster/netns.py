"""A real N-node Slurm cluster on one machine (N = 2..4): one network namespace per node, all
joined through a bridge that lives in a namespace of its own.

Brought up by `Cluster(nodes=N, instance=I)` (dev_cluster/__init__.py, the CLI
`tools/slurm_local.py start --nodes N [--instance I]`); examples/slurm/README.md shows it in use.

    instance 0 (default):  node nJ in netns mvmoe_nJ, veth mvmoeJ = 10.77.12.J/24;
                           bridge netns mvmoe_br (bridge br0, ports bJ); ports 6917/6918
    instance I > 0:        prefix mvw<I> (netns mvw<I>_nJ, veth mvw<I>J), subnet 10.77.(12+I),
                           ports 6917+2I / 6918+2I, state dir /tmp/mvmoe_slurm_i<I>

Design choices:
- A bridge in its own namespace, not a veth mesh: each node has ONE link (its veth), like a
  node with one NIC on a switch, so that link's counters are the node's inter-node traffic
  and one `tc` rule per direction shapes it (egress of mvmoeJ = node -> switch, egress of
  the bridge port bJ = switch -> node). Ranks on the same node talk over the node's `lo`.
- Instances differ in every name, subnet, port and state dir, so two clusters (two tests,
  two helpers) can run side by side without touching each other.
- Nothing in /etc changes: each slurmd runs in its own mount + UTS namespace
  (`unshare -m -u --propagation private`) with a private hosts file bind-mounted over
  /etc/hosts and hostname nJ; jobs inherit both. A node's hosts file names only itself
  (gloo binds to the address its hostname resolves to), so other nodes' names do not
  resolve inside a job: the rendezvous takes rank 0's address from Slurm (NodeAddr).
- Its own munged, socket and key copy in the state dir (AuthInfo=socket=...).
- Traffic stays inside the namespaces this module creates; clients (sbatch, srun, scontrol)
  run in n1's namespace: `slurm_local.py exec -- sbatch ...` or the printed prefix.
- Stop: cancel the jobs, kill the recorded daemons, SIGKILL whatever still runs inside
  this cluster's namespaces (only processes of this cluster can be there), delete the
  namespaces (veths and tc rules go with them), unmount /run/netns if this module mounted it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mvmoe.dev_cluster import processes
from megatron_mvmoe.dev_cluster.processes import wait_for

MAX_NODES = 4
MAX_INSTANCE = 200
COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")


@dataclass(frozen=True)
class Layout:
    """Names, addresses and ports of one cluster instance."""

    nodes: int = 2
    """Node count N (2..MAX_NODES)."""
    instance: int = 0
    """0 keeps the historical names (mvmoe_n1, 10.77.12.x); others get their own."""

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes: {self.nodes} namespaced nodes. Fix: use 2..{MAX_NODES}")
        if not 0 <= self.instance < MAX_INSTANCE:
            raise ValueError(f"--instance: {self.instance} is out of range. Fix: use 0..{MAX_INSTANCE - 1}")

    @property
    def prefix(self) -> str:
        return "mvmoe" if self.instance == 0 else f"mvw{self.instance}"

    @property
    def names(self) -> List[str]:
        return [f"n{j}" for j in range(1, self.nodes + 1)]

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}_br"

    @property
    def subnet(self) -> str:
        return f"10.77.{12 + self.instance}"

    @property
    def ctld_port(self) -> int:
        return 6917 + 2 * self.instance

    @property
    def slurmd_port(self) -> int:
        return 6918 + 2 * self.instance

    @property
    def partition(self) -> str:
        return "local2" if self.instance == 0 else f"wire{self.instance}"

    def netns(self, node: str) -> str:
        return f"{self.prefix}_{node}"

    def veth(self, node: str) -> str:
        """The node's end of its link (in the node's namespace)."""
        return f"{self.prefix}{node[1:]}"

    def port(self, node: str) -> str:
        """The bridge's end of the node's link (in the bridge namespace)."""
        return f"b{node[1:]}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{node[1:]}"

    def all_netns(self) -> List[str]:
        return [*(self.netns(n) for n in self.names), self.bridge_ns]

    def client_prefix(self) -> List[str]:
        """Prefix a Slurm client command with this to run it in n1's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns('n1')}"]


def default_state_dir(instance: int) -> Path:
    if instance == 0:
        return Path(os.environ.get("MVMOE_SLURM2_STATE", "/tmp/mvmoe_slurm2"))
    return Path(f"/tmp/mvmoe_slurm_i{instance}")


def _sh(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


# ---------------------------------------------------------------- network
def namespaces_exist(c: Layout) -> Dict[str, bool]:
    return {ns: Path(f"/run/netns/{ns}").exists() for ns in c.all_netns()}


def is_mount_point(path: str) -> bool:
    """From /proc/self/mountinfo: os.path.ismount misses bind mounts within one file system,
    which is what `ip netns add` makes of /run/netns."""
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == path for line in fh)


def create_network(c: Layout) -> bool:
    """Node namespaces, a bridge namespace, one veth per node into the bridge. Returns
    whether /run/netns was already a mount point (so stop knows whether to unmount it)."""
    was_mounted = is_mount_point("/run/netns")
    for ns in c.all_netns():
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
    br = c.bridge_ns
    _sh(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
    _sh(["ip", "-n", br, "link", "set", "br0", "up"])
    for node in c.names:
        _sh(["ip", "link", "add", c.veth(node), "netns", c.netns(node), "type", "veth",
             "peer", "name", c.port(node), "netns", br])
        _sh(["ip", "-n", br, "link", "set", c.port(node), "master", "br0"])
        _sh(["ip", "-n", br, "link", "set", c.port(node), "up"])
        _sh(["ip", "-n", c.netns(node), "addr", "add", f"{c.address(node)}/24", "dev",
             c.veth(node)])
        _sh(["ip", "-n", c.netns(node), "link", "set", c.veth(node), "up"])
    return was_mounted


def pids_in_namespaces(c: Layout) -> List[int]:
    pids: List[int] = []
    for ns, exists in namespaces_exist(c).items():
        if exists:
            out = _sh(["ip", "netns", "pids", ns], check=False)
            pids += [int(p) for p in out.stdout.split()]
    return sorted(set(pids) - {os.getpid()})


def kill_namespace_processes(c: Layout, grace_s: float = 5.0) -> List[int]:
    """SIGTERM, then SIGKILL, every process still inside this cluster's namespaces (jobs
    whose slurmd is gone): a namespace outlives `ip netns del` while a process holds it."""
    found = pids_in_namespaces(c)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_in_namespaces(c):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not wait_for(lambda: not pids_in_namespaces(c), grace_s):
            continue
        break
    return found


def delete_network(c: Layout, was_mounted: bool) -> None:
    for ns in c.all_netns():
        if Path(f"/run/netns/{ns}").exists():
            _sh(["ip", "netns", "del", ns], check=False)
    while (not was_mounted and is_mount_point("/run/netns")
           and not os.listdir("/run/netns")):
        if _sh(["umount", "/run/netns"], check=False).returncode != 0:
            break


def read_counters(c: Layout) -> Dict[str, Dict[str, int]]:
    """rx/tx bytes and packets of each node's link, node side, keyed by veth name: read
    from /proc/net/dev inside the node's namespace (a sysfs mount shows the host's)."""
    counters = {}
    for node in c.names:
        if not Path(f"/run/netns/{c.netns(node)}").exists():
            continue
        out = _sh(["ip", "netns", "exec", c.netns(node), "cat", "/proc/net/dev"], check=False)
        parsed = parse_proc_net_dev(out.stdout).get(c.veth(node))
        if parsed:
            counters[c.veth(node)] = parsed
    return counters


def parse_proc_net_dev(text: str) -> Dict[str, Dict[str, int]]:
    """{device: {rx_bytes, rx_packets, tx_bytes, tx_packets}} from /proc/net/dev."""
    out = {}
    for line in text.splitlines()[2:]:
        if ":" not in line:
            continue
        name, fields = line.split(":", 1)
        v = [int(x) for x in fields.split()]
        out[name.strip()] = {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8],
                             "tx_packets": v[9]}
    return out


# ---------------------------------------------------------------- files
def paths(state_dir: Path) -> Dict[str, Path]:
    return {"conf": state_dir / "slurm.conf", "daemons": state_dir / "daemons.json",
            "ctld": state_dir / "ctld", "spool": state_dir / "spool",
            "logs": state_dir / "logs", "munge": state_dir / "munge"}


def write_files(c: Layout, state_dir: Path, resources: Dict[str, str]) -> None:
    p = paths(state_dir)
    for d in (p["ctld"], p["logs"], p["munge"], *(p["spool"] / n for n in c.names)):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(p["munge"], 0o700)
    key = p["munge"] / "munge.key"
    key.unlink(missing_ok=True)
    shutil.copyfile("/etc/munge/munge.key", key)
    os.chmod(key, 0o400)
    for node in c.names:
        (state_dir / f"hosts.{node}").write_text(
            f"127.0.0.1\tlocalhost\n{c.address(node)}\t{node}\n")
    p["conf"].write_text(slurm_conf(c, state_dir, resources))


def slurm_conf(c: Layout, state_dir: Path, res: Dict[str, str]) -> str:
    p, host = paths(state_dir), socket.gethostname()
    nodes = [f"NodeName={n} NodeAddr={c.address(n)} CPUs={res['CPUs']} "
             f"RealMemory={res['RealMemory']} State=UNKNOWN" for n in c.names]
    return "\n".join([
        f"ClusterName=mvmoe-{c.partition}", f"SlurmctldHost={host}({c.address('n1')})",
        f"SlurmctldPort={c.ctld_port}", f"SlurmdPort={c.slurmd_port}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        # cred_expire: a requeued job may start again this long + 1 s after the requeue
        # (Slurm's default 120 s made the USR1 requeue test wait 2 minutes); also the step
        # launch credential's lifetime, ample for a launch on one machine.
        f"AuthInfo=socket={p['munge'] / 'munge.socket'},cred_expire=10",
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
        # the main scheduling loop every 2 s (default 60): a requeued job starts once
        # cred_expire has passed, not at the next backfill pass up to 30 s later
        "SchedulerParameters=sched_interval=2",
        "SlurmdTimeout=30", "KillWait=10", "MessageTimeout=10",
        *nodes,
        f"PartitionName={c.partition} Nodes={','.join(c.names)} Default=YES "
        "MaxTime=INFINITE State=UP",
        "",
    ])


# ---------------------------------------------------------------- daemons
def munged_cmd(state_dir: Path) -> List[str]:
    m = paths(state_dir)["munge"]
    return ["munged", "--foreground", "--force", f"--socket={m / 'munge.socket'}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}"]


def slurmctld_cmd(c: Layout, state_dir: Path) -> List[str]:
    return [*c.client_prefix(), "slurmctld", "-D", "-c", "-f", str(paths(state_dir)["conf"])]


def slurmd_cmd(c: Layout, state_dir: Path, node: str) -> List[str]:
    """nsenter (net) -> unshare (mount, UTS) -> sh (bind hosts, set hostname) -> exec slurmd:
    each step execs the next, so the PID recorded ends up being slurmd's own."""
    hosts, conf = state_dir / f"hosts.{node}", paths(state_dir)["conf"]
    script = (f"mount --bind {hosts} /etc/hosts && hostname {node} && "
              f"exec slurmd -D -N {node} -f {conf}")
    return ["nsenter", f"--net=/run/netns/{c.netns(node)}", "unshare", "-m", "-u",
            "--propagation", "private", "sh", "-c", script]


def munge_answers(state_dir: Path) -> bool:
    sock = str(paths(state_dir)["munge"] / "munge.socket")
    cred = subprocess.run(["munge", "-n", f"--socket={sock}"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge", f"--socket={sock}"], input=cred.stdout,
                          capture_output=True, timeout=10).returncode == 0


def client_env(state_dir: Path) -> Dict[str, str]:
    return processes.client_env(paths(state_dir)["conf"])


def node_states(c: Layout, state_dir: Path) -> Optional[Dict[str, str]]:
    """{node: state} from sinfo run in n1's namespace, or None when slurmctld is unreachable."""
    try:
        out = subprocess.run([*c.client_prefix(), "sinfo", "-h", "-N", "-o", "%N %T"],
                             capture_output=True, text=True, timeout=15,
                             env=client_env(state_dir))
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    return dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())


def cancel_jobs(c: Layout, state_dir: Path) -> None:
    """scancel every job of this cluster's partition (best effort, bounded)."""
    try:
        subprocess.run([*c.client_prefix(), "scancel", "--partition", c.partition],
                       capture_output=True, timeout=15, env=client_env(state_dir))
    except subprocess.TimeoutExpired:
        pass
