"""`python -m megatron_mvmoe.launch`: print the rendezvous this process would use.

    python -m megatron_mvmoe.launch --json                 # under any launcher
    read ADDR PORT < <(python -m megatron_mvmoe.launch --field slurm_master)   # in sbatch
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

from megatron_mvmoe.launch.rendezvous import rendezvous_from_env, slurm_master


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Print this process's rendezvous.")
    parser.add_argument("--json", action="store_true", help="print the Rendezvous as one JSON line")
    parser.add_argument("--field", choices=["master_addr", "master_port", "slurm_master"],
                        help="print one value; slurm_master prints 'ADDR PORT' from the Slurm job env")
    args = parser.parse_args(argv)
    try:
        if args.field == "slurm_master":
            print(*slurm_master(os.environ))
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
