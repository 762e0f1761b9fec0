"""`python -m megatron_mvmoe.dev_cluster ...`: the CLI of tools/slurm_local.py (the reaper
runs through it)."""

import sys

from megatron_mvmoe.dev_cluster.cli import main

raise SystemExit(main(sys.argv[1:]))
