"""Which implementation of torch's AdamW steps the run (optimizer.torch_adam_impl).

Without Transformer Engine or Apex (every CPU run, and a GPU run without either)
Megatron-Core builds `torch.optim.AdamW` with torch's defaults (foreach=None, fused=None):
torch then picks per step, the per-tensor for-loop for CPU tensors and foreach for CUDA ones.
That is what a Megatron-LM line runs there, and what `default` keeps. The others pin one:

| impl | param-group flags | issue-42 shape, 1 CPU thread (tools/bench_adam_impl.py) |
|---|---|---|
| default | foreach None, fused None | torch's choice (CPU: the for-loop) |
| for_loop | foreach False, fused False | 54 ms/step; bit-identical to default on CPU |
| foreach | foreach True, fused False | 52-95 ms/step; bit-identical (a loop of the same kernels) |
| fused | foreach False, fused True | 14 ms/step; not bit-identical (2.4e-7 after 7 steps) |

Design choices:
- The flags live in each torch param group, and torch's `load_state_dict` takes the saved
  groups whole: a checkpoint written under another implementation (or another version's
  default) would switch the run's implementation silently. So the configured one is
  applied after the build and again after every checkpoint load (`apply_adam_impl`);
  tests/training/test_adam_impl.py shows the checkpoint's flag winning without it.
- Only torch Adam/AdamW instances are touched (Megatron's TE/Apex FusedAdam on GPU, Muon
  and SGD have no such flags); a run with none of them is left alone.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

IMPL_FLAGS: Dict[str, Tuple[Optional[bool], Optional[bool]]] = {
    "default": (None, None),
    "for_loop": (False, False),
    "foreach": (True, False),
    "fused": (False, True),
}
"""optimizer.torch_adam_impl -> the (foreach, fused) every torch Adam param group gets."""


def torch_adams(optimizer) -> Iterator[torch.optim.Adam]:
    """The torch Adam/AdamW instances inside Megatron's optimizer wrappers (chained,
    distributed, mixed-precision, fp32)."""
    if isinstance(optimizer, torch.optim.Adam):
        yield optimizer
        return
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        inner = [getattr(optimizer, "optimizer", None)]
    for one in inner:
        if one is not None and one is not optimizer:
            yield from torch_adams(one)


def apply_adam_impl(optimizer, impl: str) -> int:
    """Sets every torch Adam param group's foreach/fused to `impl`'s; returns the groups
    set. Collective-free; call after the build and after each checkpoint load."""
    foreach, fused = IMPL_FLAGS[impl]
    groups = 0
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            group["foreach"], group["fused"] = foreach, fused
            groups += 1
    return groups


def adam_impl_line(impl: str) -> Optional[str]:
    """The start-up banner's line when the run's AdamW differs from what a Megatron-LM line
    builds without TE/Apex (torch's default); None when it is that default."""
    if impl == "default":
        return None
    same = "bit-identical to it on CPU" if impl != "fused" else "not bit-identical to it"
    return (f"adam: torch AdamW {impl} (optimizer.torch_adam_impl; a Megatron-LM line without "
            f"TE/Apex runs torch's default, the for-loop on CPU: {same})")
