"""What a tensor collective holds in resident memory beyond its own input and output, on
the current backend: the probe behind the planner's `collective_transient`
(planning/memory.py).

Measured on torch 2.13's gloo: `all_gather_into_tensor` and `reduce_scatter_tensor` stage the
whole flat buffer (the gathered output, the scattered input) in a temporary of its size, at
any group size, one collective at a time; `all_reduce` works in place. The distributed
optimizer calls exactly these two on every gradient and parameter buffer, so on CPU each
step holds one extra buffer twice: at the end of the backward and after the optimizer step.
A torch that stops staging makes `tests/platform/test_collective_memory.py` fail, which is
the signal to drop the term from the planner.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.platform.resident_memory import peak_rss_bytes, reset_peak_rss, rss_bytes

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _collective(op: str, flat: torch.Tensor, group) -> Callable[[], None]:
    """`op` on the world-size x shard buffer `flat`, the shard being this rank's part."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = flat.view(world, -1)[rank]
    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(flat, shard, group=group)
    if op == "reduce_scatter_tensor":
        return lambda: dist.reduce_scatter_tensor(shard, flat, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(flat, group=group)
    raise ValueError(f"op: unknown {op!r}. Fix: one of {OPS}")


def staging_bytes(op: str, shard_numel: int, group: Optional[object] = None) -> Dict[str, int]:
    """Collective over `group`: run `op` once on an fp32 buffer of world x `shard_numel`
    elements and return {"buffer_bytes", "staged_bytes"}: the buffer's size and this rank's
    resident high-water mark during the call over the resident set before it (the buffer
    itself is allocated and touched before the measurement starts)."""
    world = dist.get_world_size(group)
    _collective(op, torch.ones(world * 1024), group)()  # gloo's one-time set-up, not staging
    flat = torch.ones(world * shard_numel, dtype=torch.float32)
    run = _collective(op, flat, group)
    dist.barrier(group=group)
    if not reset_peak_rss():
        raise RuntimeError("collective memory: /proc/self/clear_refs is not writable here, "
                           "so the resident high-water mark cannot be reset. Fix: run on "
                           "Linux >= 4.0 without a read-only /proc")
    before = rss_bytes()
    run()
    staged = peak_rss_bytes() - before
    dist.barrier(group=group)
    return {"buffer_bytes": flat.numel() * flat.element_size(), "staged_bytes": staged}
