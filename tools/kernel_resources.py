"""Registers, shared memory and spills of every Triton kernel, compiled ahead of time here
for real GPU targets (no GPU needed), per kernel x target x shape set.

    python tools/kernel_resources.py [--target sm_90 sm_100] [--shapes tiny 10b] [--json]

Shape sets come from the presets: tiny = tiny_multi_view, 10b = mvmoe_10b_a1b (tokens = one
sequence per micro-batch). Sources: registers/spills from ptxas -v on the kernel's ptx
(registers checked against Triton's cubin with cuobjdump), shared memory from Triton's metadata (see mvmoe_kernels/aot.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from mvmoe_kernels import aot

SHAPE_PRESETS = {"tiny": "tiny_multi_view", "10b": "mvmoe_10b_a1b"}


def shapes_of(name: str) -> aot.KernelShapes:
    """The kernel sizes of a shape set, read from its preset."""
    from megatron_mvmoe.config.presets import PRESETS

    p = PRESETS[SHAPE_PRESETS[name]]
    return aot.KernelShapes(tokens=p["seq_length"], experts=p["num_experts"],
                            topk=p["moe_router_topk"], heads=p["multi_view"]["num_routers"],
                            latent=p["latent_size"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", nargs="+", default=list(aot.TARGETS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPE_PRESETS))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        aot.check_targets(args.target)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    bad = [s for s in args.shapes if s not in SHAPE_PRESETS]
    if bad:
        print(f"error: --shapes: unknown shape set {bad[0]!r}. Fix: use one of "
              f"{', '.join(SHAPE_PRESETS)}", file=sys.stderr)
        return 2
    rows = aot.compile_isolated({s: shapes_of(s) for s in args.shapes}, args.target)
    if args.json:
        print(json.dumps(dict(shapes={s: vars(shapes_of(s)) for s in args.shapes},
                              results=rows), indent=1))
        return 0
    print("| kernel | target | shapes | regs | shared B | spill st/ld B | warps | stages "
          "| ptx B | cubin B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['target']} | {r['shapes']} | {r['registers']} | "
              f"{r['shared_bytes']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | "
              f"{r['num_warps']} | {r['num_stages']} | {r['ptx_bytes']} | {r['cubin_bytes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
