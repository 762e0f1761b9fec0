"""How much resident memory gloo's tensor collectives stage beyond their own buffers: the
measurement behind the planner's collective transient (planning/memory.py), run on
local gloo ranks of this machine.

    python tools/gloo_collective_memory.py [--world-sizes 1 2 4] [--mib 100] [--json]

For each world size and collective (all_gather_into_tensor and reduce_scatter_tensor, which
the distributed optimizer runs on every parameter / gradient buffer, and all_reduce for
comparison), every rank runs the collective once on an fp32 buffer of world x shard
elements (shard = MIB MiB) and reports its resident high-water mark during the call over
its resident set before it. `staged / buffer` near 1 means the whole buffer is staged in a
temporary; near 0, the collective works in place.
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional

from megatron_mvmoe.launch.local_ranks import run_distributed
from megatron_mvmoe.platform.collective_memory import OPS


def _rank(rank: int, world: int, shard_numel: int) -> Dict[str, Dict[str, int]]:
    from megatron_mvmoe.platform.collective_memory import staging_bytes

    return {op: staging_bytes(op, shard_numel) for op in OPS}


def measure(world_sizes: List[int], mib: float) -> List[Dict]:
    """One row per world size x op: buffer and staged bytes, the largest over the ranks."""
    rows = []
    shard = int(mib * 2**20) // 4
    for world in world_sizes:
        ranks = run_distributed(_rank, world, args=(shard,), timeout_s=300)
        for op in OPS:
            staged = max(r[op]["staged_bytes"] for r in ranks)
            buffer = ranks[0][op]["buffer_bytes"]
            rows.append({"world_size": world, "op": op, "buffer_bytes": buffer,
                         "staged_bytes": staged, "staged_over_buffer": staged / buffer})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--mib", type=float, default=64.0,
                        help="MiB of this rank's shard (the buffer is world x this)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.mib <= 0 or any(w < 1 for w in args.world_sizes):
        parser.error("--mib must be > 0 and every --world-sizes entry >= 1")
    rows = measure(args.world_sizes, args.mib)
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(f"{'world':>5} {'collective':24s} {'buffer MiB':>10} {'staged MiB':>10} "
          f"{'staged/buffer':>13}")
    for r in rows:
        print(f"{r['world_size']:5d} {r['op']:24s} {r['buffer_bytes'] / 2**20:10.1f} "
              f"{r['staged_bytes'] / 2**20:10.1f} {r['staged_over_buffer']:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
