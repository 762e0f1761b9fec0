"""Start, stop or inspect a dev Slurm cluster (root): one node on localhost, or (--nodes
2..4) nodes in network namespaces on a bridge. `exec -- CMD...` runs a Slurm client command
(sbatch, srun, scontrol) where the namespaced cluster's controller is reachable; `reap --pid P`
stops the cluster once P is gone. tools/slurm_local.py is its front door."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mvmoe.dev_cluster import Cluster, localhost
from megatron_mvmoe.dev_cluster.processes import DevClusterError


def _cluster(args) -> Cluster:
    """What the command acts on: start builds the requested cluster; the others the one the
    state dir recorded (a namespaced cluster whenever --nodes >= 2, --instance or reap)."""
    if args.nodes >= 2 or args.instance or args.command in ("reap", "exec"):
        if args.command == "start":
            return Cluster(max(args.nodes, 2), args.instance, args.state_dir)
        return Cluster.recorded(args.instance, args.state_dir, args.nodes)
    return Cluster(1, 0, args.state_dir)


def _dispatch(cluster: Cluster, args) -> Dict[str, object]:
    if args.command == "start":
        return cluster.start(args.timeout_s)
    if args.command == "reap":
        return cluster.reap(args.pid)
    return cluster.stop() if args.command == "stop" else cluster.status()


def main(argv: List[str], description: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "stop", "status", "exec", "reap"])
    parser.add_argument("rest", nargs="*", help="exec: the command to run (after --)")
    parser.add_argument("--nodes", type=int, choices=[1, 2, 3, 4], default=1,
                        help="1: one-node cluster on localhost; 2..4: namespaced nodes on a "
                        "bridge")
    parser.add_argument("--instance", type=int, default=0,
                        help="namespaced clusters: 0 = mvmoe_nJ, 10.77.12.J; I > 0 = its own "
                        "names (mvwI_nJ), subnet 10.77.(12+I), ports and state dir")
    parser.add_argument("--pid", type=int, default=None, help="reap: the process to outlive")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where slurm.conf, logs, state and recorded PIDs live (default "
                        f"{localhost.DEFAULT_STATE_DIR}, /tmp/mvmoe_slurm2 with --nodes >= 2, "
                        "/tmp/mvmoe_slurm_iI with --instance I)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="start: wait this long for 'idle'")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.rest = rest or args.rest
    if args.command == "exec":
        return _cluster(args).exec(args.rest)
    if args.command == "reap" and not args.pid:
        parser.error("reap: --pid is required")
    try:
        result = _dispatch(_cluster(args), args)
    except (DevClusterError, subprocess.SubprocessError, OSError, ValueError) as err:
        if args.json:
            print(json.dumps({"error": str(err), "command": args.command}))
        else:
            print(f"slurm_local {args.command}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        state = result.get("node_states") or result.get("node_state")
        print(f"running={result['running']} nodes={result.get('nodes', 1)} state={state} "
              f"pids={result['pids']}")
        if result["running"]:
            print(f"export SLURM_CONF={result['slurm_conf']}")
            if result.get("client_prefix"):
                print(f"clients: {' '.join(result['client_prefix'])} sbatch ...")
    return 0 if args.command in ("stop", "status", "reap") or result["running"] else 1
