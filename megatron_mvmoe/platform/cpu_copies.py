"""Two copies Megatron-Core 0.19.2's CPU path makes every step that compute nothing
(issue 42 item 2, measured with tools/profile_step.py at the smoe shape of
training/step_bench.py):

- Grad clipping without apex / TransformerEngine: `utils.local_multi_tensor_scale` (the
  fallback for amp_C.multi_tensor_scale) scales each grad as `dst.copy_(src * scale)`, a
  fresh tensor and a copy per parameter, where clipping passes the same list as source and
  destination. In place (`torch._foreach_mul_`) it is the same fp32 multiply, bit for bit;
  a pair of distinct tensors still takes Megatron's own path.
- The alltoall dispatcher's `sort_chunks_by_idxs` (dispatch_postprocess / combine_preprocess,
  whenever a rank holds several experts) splits the tokens into chunks and concatenates
  them back in `sorted_idxs` order; at EP = TP = 1 that order is the identity, so the
  concatenation (and its backward's) copies the tokens into the same order. At the identity
  the input is returned (probs too); any other order is Megatron's own.

CPU only (cpu_patches PATCHES); tests/platform/test_cpu_copies.py checks both against
Megatron's originals bit for bit.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.patch import Patch, rebind

_UTILS = "megatron.core.utils"
_SCALE_USERS = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_SORT_USERS = ("megatron.core.transformer.moe.token_dispatcher",)


def _scale_in_place() -> None:
    utils = importlib.import_module(_UTILS)
    original = utils.local_multi_tensor_scale
    if getattr(original, "_mvmoe_wrapped", False):
        return

    @functools.wraps(original)
    def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
        sources, destinations = tensor_lists[0], tensor_lists[1]
        if all(s is d for s, d in zip(sources, destinations)):
            if destinations:
                torch._foreach_mul_(list(destinations), scale)
            return
        original(chunk_size, noop_flag, tensor_lists, scale)

    local_multi_tensor_scale._mvmoe_wrapped = True
    for name in (_UTILS, *_SCALE_USERS):
        module = importlib.import_module(name)
        if getattr(module, "multi_tensor_scale_impl", None) is original:
            module.multi_tensor_scale_impl = local_multi_tensor_scale
    rebind(_UTILS, "local_multi_tensor_scale", local_multi_tensor_scale, ())


def _scale_copies() -> bool:
    """True while grad clipping's CPU scale is Megatron's copy-per-tensor loop."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    impl = clip_grads.multi_tensor_scale_impl
    return (not getattr(impl, "_mvmoe_wrapped", False)
            and "copy_(src * scale)" in inspect.getsource(impl))


def _is_identity(sorted_idxs: torch.Tensor) -> bool:
    return bool(torch.equal(sorted_idxs.cpu(), torch.arange(sorted_idxs.numel())))


def _identity_sort_returns_input() -> None:
    moe_utils = importlib.import_module(_MOE_UTILS)
    original = moe_utils.sort_chunks_by_idxs
    if getattr(original, "_mvmoe_wrapped", False):
        return

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not fused and _is_identity(sorted_idxs):
            return input, probs  # the chunks already stand in this order
        return original(input, split_sizes, sorted_idxs, probs, fused)

    sort_chunks_by_idxs._mvmoe_wrapped = True
    rebind(_MOE_UTILS, "sort_chunks_by_idxs", sort_chunks_by_idxs, _SORT_USERS)


def _identity_sort_copies() -> bool:
    """True while the dispatcher's chunk sort copies the tokens at the identity order."""
    sort = importlib.import_module(_SORT_USERS[0]).sort_chunks_by_idxs
    tokens = torch.arange(12.0).reshape(6, 2)
    output, _ = sort(tokens, torch.tensor([2, 4]), torch.tensor([0, 1]))
    return output.data_ptr() != tokens.data_ptr()


CPU_COPIES = [
    Patch("in-place grad clip scale",
          "utils.local_multi_tensor_scale (clip_grads' scale without apex/TE) writes "
          "dst.copy_(src * scale) for every grad: a fresh tensor and a copy each.",
          _scale_in_place, _scale_copies),
    Patch("identity chunk sort",
          "moe_utils.sort_chunks_by_idxs splits and concatenates the dispatched tokens even "
          "when the order is the identity (EP = TP = 1): a copy forward and backward.",
          _identity_sort_returns_input, _identity_sort_copies),
]
