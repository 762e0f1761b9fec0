"""A real Slurm cluster on this machine for development and tests (root): `Cluster(nodes=1)`
on localhost, `Cluster(nodes=N)` with N = 2..4 nodes in network namespaces on a bridge.

    cluster = Cluster(nodes=2, instance=3)
    cluster.start()                     # idempotent; waits until every node is idle
    cluster.exec(["sbatch", "job.sh"])  # a Slurm client where the controller is reachable
    cluster.stop()                      # daemons by recorded PID, namespaces, mounts

One object, one API whatever the node count; the two kinds live in localhost.py and
namespaced.py (+ netns.py), sharing processes.py. Nothing here imports the rest of the
package: the training code never depends on its test cluster.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mvmoe.dev_cluster import localhost, namespaced, netns
from megatron_mvmoe.dev_cluster.processes import DevClusterError, client_env, read_record

__all__ = ["Cluster", "DevClusterError"]


@dataclass(frozen=True)
class Cluster:
    """One dev cluster: its node count, instance and state dir."""

    nodes: int = 1
    """1: localhost (node = this host); 2..netns.MAX_NODES: namespaced nodes n1..nN."""
    instance: int = 0
    """Namespaced clusters only: 0 keeps the historical names (mvmoe_nJ, 10.77.12.J); I > 0
    gets its own names, subnet, ports and state dir, so clusters can run side by side."""
    state_dir: Optional[Path] = None
    """slurm.conf, spool, logs and the recorded daemons; None: the kind's default."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= netns.MAX_NODES:
            raise ValueError(f"--nodes: {self.nodes} nodes. Fix: use 1 (localhost) or "
                             f"2..{netns.MAX_NODES} (namespaced)")
        if self.nodes == 1 and self.instance:
            raise ValueError(f"--instance: {self.instance} needs namespaced nodes. Fix: pass "
                             "--nodes 2..4 with --instance, or drop --instance")

    @classmethod
    def recorded(cls, instance: int = 0, state_dir: Optional[Path] = None,
                 nodes: int = 2) -> "Cluster":
        """The namespaced cluster a state dir recorded (its node count), else `nodes`: what
        stop / status / exec / reap act on."""
        state = (state_dir or netns.default_state_dir(instance)).resolve()
        return cls(int(read_record(state).get("nodes") or max(nodes, 2)), instance, state)

    @property
    def namespaced(self) -> bool:
        return self.nodes >= 2

    @property
    def layout(self) -> netns.Layout:
        """Names, addresses, links and ports of the namespaced nodes."""
        if not self.namespaced:
            raise ValueError("layout: a one-node cluster has no namespaces. Fix: "
                             "Cluster(nodes=2..4)")
        return netns.Layout(self.nodes, self.instance)

    @property
    def state(self) -> Path:
        default = (netns.default_state_dir(self.instance) if self.namespaced
                   else localhost.DEFAULT_STATE_DIR)
        return (self.state_dir or default).resolve()

    def start(self, timeout_s: float = 60.0) -> Dict[str, object]:
        if self.namespaced:
            return namespaced.start(self.layout, self.state, timeout_s)
        return localhost.start(self.state, timeout_s)

    def stop(self) -> Dict[str, object]:
        if self.namespaced:
            return namespaced.stop(self.layout, self.state)
        return localhost.stop(self.state)

    def status(self) -> Dict[str, object]:
        if self.namespaced:
            return namespaced.status(self.layout, self.state)
        return localhost.status(self.state)

    def exec(self, command: List[str]) -> int:
        """Run a Slurm client command (sbatch, srun, scontrol) with SLURM_CONF set, in n1's
        network namespace when namespaced."""
        if self.namespaced:
            return namespaced.exec_command(self.layout, command, self.state)
        conf = self.state / "slurm.conf"
        return subprocess.run(command, env=client_env(conf)).returncode

    def client_env(self) -> Dict[str, str]:
        return client_env(self.state / "slurm.conf")

    def reap(self, pid: int) -> Dict[str, object]:
        """Wait until `pid` is gone, then stop (namespaced clusters)."""
        return namespaced.reap(self.layout, self.state, pid)

    def spawn_reaper(self, pid: int) -> int:
        """A detached process that stops this cluster once `pid` is gone."""
        return namespaced.spawn_reaper(self.layout, self.state, pid)
