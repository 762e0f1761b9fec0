"""platform/cpu_copies.py: grad clipping scales in place and the dispatcher's identity chunk
sort returns its input, bit-identical to Megatron-Core's own copies."""

import importlib

import pytest
import torch

from megatron_mvmoe.platform import apply_cpu_patches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches")


def _patched(module: str, name: str):
    apply_cpu_patches()
    return getattr(importlib.import_module(module), name)


def test_identity_chunk_sort_returns_its_input_and_other_orders_match_megatron():
    sort = _patched("megatron.core.transformer.moe.token_dispatcher", "sort_chunks_by_idxs")
    tokens, probs = torch.randn(10, 4), torch.rand(10)
    sizes = torch.tensor([3, 0, 5, 2])
    out, out_probs = sort(tokens, sizes, torch.arange(4), probs)
    assert out.data_ptr() == tokens.data_ptr() and out_probs is probs  # no copy
    order = torch.tensor([2, 0, 3, 1])
    chunks = torch.split(tokens, sizes.tolist())
    want = torch.cat([chunks[i] for i in order.tolist()])
    got, _ = sort(tokens, sizes, order)
    assert torch.equal(got, want)


def test_clip_scale_in_place_is_bit_identical():
    scale_impl = _patched("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl")
    assert getattr(scale_impl, "_mvmoe_wrapped", False)
    grads = [torch.randn(7, 5), torch.randn(3)]
    want = [g * 0.37 for g in grads]  # Megatron's dst.copy_(src * scale)
    pointers = [g.data_ptr() for g in grads]
    scale_impl(2048, None, [grads, grads], 0.37)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))
    assert [g.data_ptr() for g in grads] == pointers
    src, dst = [torch.randn(4)], [torch.empty(4)]  # distinct tensors: Megatron's path
    scale_impl(2048, None, [src, dst], 2.0)
    assert torch.equal(dst[0], src[0] * 2.0)
