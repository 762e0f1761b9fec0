"""Smoke-test a launch: rendezvous, one all_reduce, Megatron's parallel state.

Run it under any launcher; each rank prints one JSON line and exits non-zero on a
failed check:
    torchrun --nproc_per_node 2 tools/launch_check.py --json
    mpirun --allow-run-as-root --oversubscribe --bind-to none --mca oob_tcp_if_include lo \
        --mca btl self,vader -np 2 python tools/launch_check.py --json
    srun -n 2 python tools/launch_check.py --json      (or examples/slurm/local_cpu_smoke.sbatch)

Checks, in order:
1. init_distributed() from the launcher's environment (megatron_mvmoe.launch);
2. all_reduce of (rank + 1) on the default group equals world*(world+1)/2;
3. Megatron parallel state for --tp/--pp/--ep/--etp via megatron_mvmoe.parallel,
   then an all_reduce of ones on each model-parallel group equals that group's size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_mvmoe import platform
from megatron_mvmoe.launch import init_distributed

# Megatron warns once per process that TE/Apex are absent (expected on CPU); keep the
# per-rank output readable.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout  # noqa: E402

GROUPS = ("tp", "pp", "ep", "expt_tp", "dp", "expt_dp")
"""ProcessGroupCollection attributes checked with an all_reduce each."""


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Check a distributed launch (one JSON line per rank).")
    parser.add_argument("--json", action="store_true", help="print one JSON line per rank")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="process-group backend (default: the platform's: nccl on CUDA, gloo on CPU)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="rendezvous/collective timeout")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel size (0: world/(tp*pp*etp))")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    parser.add_argument("--no-layout", action="store_true", help="skip the Megatron parallel-state check")
    return parser.parse_args(argv)


def check_allreduce(device: torch.device) -> bool:
    """Sum of (rank + 1) over the world: exact in float64 for any realistic world."""
    world = dist.get_world_size()
    value = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(value)
    return value.item() == world * (world + 1) / 2


def check_layout(args: argparse.Namespace, device: torch.device) -> Dict[str, object]:
    """Build Megatron's groups for the layout and all_reduce ones over each."""
    world = dist.get_world_size()
    ep = args.ep or world // (args.tp * args.pp * args.etp)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=ep, etp=args.etp)
    groups = initialize_layout(layout)
    try:
        sizes, ok = {}, True
        for name in GROUPS:
            group = getattr(groups, name, None)
            if group is None:
                continue
            ones = torch.ones(1, dtype=torch.float64, device=device)
            dist.all_reduce(ones, group=group)
            sizes[name] = dist.get_world_size(group)
            ok = ok and ones.item() == sizes[name]
    finally:
        destroy_layout()
    return {"layout": {"tp": args.tp, "pp": args.pp, "ep": ep, "etp": args.etp},
            "group_sizes": sizes, "layout_ok": ok}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    try:
        rdzv = init_distributed(backend=args.backend, timeout_s=args.timeout_s)
    except (ValueError, RuntimeError) as err:
        print(f"launch_check: {err}", file=sys.stderr)
        return 2
    device = platform.device()
    report: Dict[str, object] = {**rdzv.to_dict(), "host": socket.gethostname(),
                                 "backend": dist.get_backend(), "device": str(device)}
    try:
        report["allreduce_ok"] = check_allreduce(device)
        if not args.no_layout:
            report.update(check_layout(args, device))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    ok = report["allreduce_ok"] and report.get("layout_ok", True)
    if args.json:
        # One write() per line: ranks share the launcher's pipe, and a write below PIPE_BUF
        # is atomic, so two ranks' JSON lines never interleave (print may write twice).
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())
    else:
        print(f"rank {rdzv.rank}/{rdzv.world_size} via {rdzv.launcher} on {report['host']}: "
              f"allreduce {'ok' if report['allreduce_ok'] else 'WRONG'}, "
              f"layout {report.get('layout_ok', 'skipped')}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
