"""`python -m megatron_mvmoe.launch`: print the rendezvous this process would use.

    python -m megatron_mvmoe.launch --json                 # under any launcher
    read ADDR PORT < <(python -m megatron_mvmoe.launch --field slurm_master)   # in sbatch
    torchrun --local-addr "$(python -m megatron_mvmoe.launch --field node_addr)" ...

slurm_master and node_addr prefer Slurm's NodeAddr (`scontrol show node`): the value is
handed to other nodes, where this node's name may not resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Optional, Sequence

from megatron_mvmoe.launch.rendezvous import (rendezvous_from_env, scontrol_node_addr,
                                              slurm_master, slurm_node_address)


def _node_addr_first(name: str) -> Optional[str]:
    return scontrol_node_addr(name) or slurm_node_address(name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Print this process's rendezvous.")
    parser.add_argument("--json", action="store_true", help="print the Rendezvous as one JSON line")
    parser.add_argument("--field", choices=["master_addr", "master_port", "slurm_master",
                                            "node_addr"],
                        help="print one value; slurm_master prints 'ADDR PORT' from the Slurm "
                        "job env; node_addr prints this node's address (Slurm NodeAddr of "
                        "SLURMD_NODENAME, else the hostname)")
    args = parser.parse_args(argv)
    try:
        if args.field == "slurm_master":
            print(*slurm_master(os.environ, _node_addr_first))
            return 0
        if args.field == "node_addr":
            name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
            print(_node_addr_first(name) or name)
            return 0
        rdzv = rendezvous_from_env()
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    if args.field:
        print(getattr(rdzv, args.field))
    elif args.json:
        print(json.dumps(rdzv.to_dict()))
    else:
        print(", ".join(f"{k}={v}" for k, v in rdzv.to_dict().items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
