"""platform/cpu_rope.py: RoPE without concatenations, bit-identical to Megatron-Core's
unfused RoPE forward and backward; the cases it does not serve stay Megatron's."""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mvmoe.platform import apply_cpu_patches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches")


def _patched_and_original():
    apply_cpu_patches()
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    patched = rope_utils._apply_rotary_pos_emb_bshd
    assert getattr(patched, "_mvmoe_wrapped", False)
    return patched, patched.__wrapped__


class _CountCats(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func.overloadpacket is torch.ops.aten.cat
        return func(*args, **(kwargs or {}))


def _forward_backward(rope, qkv, freqs, **kwargs):
    qkv = qkv.detach().requires_grad_()
    query = qkv[..., :8]  # a strided view, as the QKV split hands RoPE
    out = rope(query, freqs, **kwargs)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
    return out, qkv.grad


@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_rope_without_cats_is_bit_identical_forward_and_backward(mscale):
    patched, original = _patched_and_original()
    qkv = torch.randn(6, 2, 3, 24)  # [s, b, heads, 3 x head dim 8]
    freqs = torch.randn(6, 1, 1, 8)
    want, want_grad = _forward_backward(original, qkv, freqs, mscale=mscale)
    with _CountCats() as counted:
        got, got_grad = _forward_backward(patched, qkv, freqs, mscale=mscale)
    assert counted.cats == 0  # Megatron's makes 3: two forward, the halves' regather backward
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert got.is_contiguous()  # as Megatron's cat returns it


def test_rope_cases_it_does_not_serve_are_megatrons():
    patched, original = _patched_and_original()
    qkv, freqs = torch.randn(6, 2, 3, 24), torch.randn(6, 1, 1, 4)  # RoPE on part of the head
    for kwargs in ({}, {"rotary_interleaved": True}):
        want, want_grad = _forward_backward(original, qkv, freqs[..., :4], **kwargs)
        got, got_grad = _forward_backward(patched, qkv, freqs[..., :4], **kwargs)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
