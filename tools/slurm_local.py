"""Start, stop or inspect a dev Slurm cluster (root, no systemd): one node on localhost, or
2..4 nodes in network namespaces on a bridge.

    python tools/slurm_local.py start [--json]    # munged, slurmctld, slurmd; waits for 'idle'
    export SLURM_CONF=/tmp/mvmoe_slurm/slurm.conf  # printed by start; sbatch/srun/sinfo need it
    python tools/slurm_local.py status [--json]
    python tools/slurm_local.py stop [--json]     # kills only the daemons start recorded
    python tools/slurm_local.py start --nodes 2    # two nodes n1, n2 in network namespaces
    python tools/slurm_local.py exec -- sbatch ... # a client command in n1's namespace
    python tools/slurm_local.py stop --nodes 2     # daemons by PID, namespaces, veth, mounts
    python tools/slurm_local.py start --nodes 4 --instance 3  # 4 nodes, names mvw3_*
    python tools/slurm_local.py reap --pid P --nodes 4 --instance 3  # stop it once P is gone

The cluster is `megatron_mvmoe.dev_cluster.Cluster(nodes=N, instance=I)` (its design
choices are in megatron_mvmoe/dev_cluster/localhost.py and netns.py); this tool is its
command line. Every file lives in one state dir (default /tmp/mvmoe_slurm, /tmp/mvmoe_slurm2
with --nodes >= 2); `stop` signals exactly the daemons `start` recorded, never by name.
"""

import sys

from megatron_mvmoe.dev_cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], description=__doc__))
