"""The distributed optimizer's grad reduce-scatter and param all-gather at a group of one rank
(every 1-rank CPU run, and the data-parallel group of one at EP = world size): Megatron-Core
0.19.2 calls them whatever the group size, and gloo's coalesced reduce-scatter clones the
whole grad buffer (4 bytes a parameter) and copies it back every step, all to compute the
identity: a one-rank SUM or AVG of a shard that is the whole buffer, and an all-gather of
the whole buffer into itself. Measured at issue 42's smoe shape (15.7 M parameters, one
thread): 0.05-0.07 s a step of a 0.7 s step (tools/bench_trainer_overhead.py).

Fixed where Megatron names the collective (`param_and_grad_buffer.dist_reduce_scatter_func`
/ `dist_all_gather_func`, module globals it looks up at call time): at a group of one rank
and synchronously, the output is the input (a copy only where they are different storage);
every other call is Megatron's own. Numerics are unchanged (the identity), so checkpoints
and resumes are too (tests/platform/test_one_rank_collectives.py). CPU only (cpu_patches
PATCHES): GPU runs use Megatron-Core unmodified.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.patch import Patch

_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_NAMES = ("dist_reduce_scatter_func", "dist_all_gather_func")


def _identity_at_one_rank(collective):
    @functools.wraps(collective)
    def at_one_rank(output, input_, *args, group=None, async_op=False, **kwargs):
        if async_op or group is None or group.size() != 1 or output.numel() != input_.numel():
            return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input_.data_ptr():
            with torch.no_grad():
                output.copy_(input_.view_as(output))
        return None

    at_one_rank._mvmoe_wrapped = True
    return at_one_rank


def _skip_one_rank_collectives() -> None:
    module = importlib.import_module(_BUFFER)
    for name in _NAMES:
        original = getattr(module, name)
        if not getattr(original, "_mvmoe_wrapped", False):
            setattr(module, name, _identity_at_one_rank(original))


def _one_rank_collectives_run() -> bool:
    """True while a bucket group's grad sync still reaches the module's collective at a group
    of one rank: the collective is Megatron's own and start_grad_sync does not test the
    group's size itself (a future Megatron that does makes this patch unneeded)."""
    module = importlib.import_module(_BUFFER)
    unwrapped = any(not getattr(getattr(module, name), "_mvmoe_wrapped", False)
                    for name in _NAMES)
    source = inspect.getsource(module._ParamAndGradBucketGroup.start_grad_sync)
    return unwrapped and "size() == 1" not in source and "size() > 1" not in source


ONE_RANK_COLLECTIVES = Patch(
    "one-rank grad reduce-scatter",
    "The distributed optimizer reduce-scatters the grad buffer and all-gathers the params "
    "over a one-rank group every step; gloo clones the whole buffer to compute the identity.",
    _skip_one_rank_collectives, _one_rank_collectives_run)
