"""RoPE without concatenations (issue 42 item 2, measured with tools/profile_step.py).

Megatron-Core 0.19.2's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`, the path
without TransformerEngine's fused kernel) computes `t * cos + _rotate_half(t) * sin` where
`_rotate_half` is `cat((-x2, x1))` of the two halves, then `cat((t, t_pass))` with an empty
`t_pass` when RoPE covers the whole head: two concatenations forward, and backward the
halves' `chunk` regather (another `cat`) and the slice's zero-filled copy, for q and k in
every layer.

Here one autograd function writes the rotated halves straight into one buffer, forward
(`neg` into the first half, a copy into the second) and backward (the transposed rotation
added into `grad * cos`). The arithmetic is the same fp32 operations on the same operands
(`a + (-b)` is `a - b` in IEEE), so output and input gradient are bit-identical
(tests/platform/test_cpu_rope.py). Only the common case takes this path: halves not
interleaved, no MLA interleaving, RoPE over the whole head, frequencies without gradient;
every other call is Megatron's own.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.patch import Patch, rebind

_ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
_ROPE_USERS = ("megatron.core.models.common.embeddings.rotary_pos_embedding",)


class _RotaryHalves(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin, the rotation written in place of the cats."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        half = t.shape[-1] // 2
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # contiguous, as cat's
        torch.mul(t, cos, out=out)
        rotated = torch.empty_like(out)
        torch.neg(t[..., half:], out=rotated[..., :half])
        rotated[..., half:].copy_(t[..., :half])
        out.add_(rotated.mul_(sin))
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_t = grad * cos
        grad_sin = grad * sin  # rotate_half's transpose: [g2, -g1] of these halves
        grad_t[..., :half].add_(grad_sin[..., half:])
        grad_t[..., half:].sub_(grad_sin[..., :half])
        return grad_t, None, None


def _takes_fast_path(t, freqs, rotary_interleaved, mla_rotary_interleaved,
                     multi_latent_attention) -> bool:
    return (not rotary_interleaved and not mla_rotary_interleaved
            and multi_latent_attention is None and not freqs.requires_grad
            and freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0)


def _rope_without_cats() -> None:
    rope_utils = importlib.import_module(_ROPE_UTILS)
    original = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(original, "_mvmoe_wrapped", False):
        return

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False,
                                   mla_rotary_interleaved=False, mscale=1.0,
                                   multi_latent_attention=None):
        if not _takes_fast_path(t, freqs, rotary_interleaved, mla_rotary_interleaved,
                                multi_latent_attention):
            return original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale,
                            multi_latent_attention)
        cos = (torch.cos(freqs) * mscale).to(t.dtype)  # Megatron's own expressions
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _RotaryHalves.apply(t, cos, sin)

    _apply_rotary_pos_emb_bshd._mvmoe_wrapped = True
    rebind(_ROPE_UTILS, "_apply_rotary_pos_emb_bshd", _apply_rotary_pos_emb_bshd, _ROPE_USERS)


def _rope_concatenates() -> bool:
    """True while Megatron's unfused RoPE rotates the halves with torch.cat."""
    rope_utils = importlib.import_module(_ROPE_UTILS)
    bshd = rope_utils._apply_rotary_pos_emb_bshd
    return (not getattr(bshd, "_mvmoe_wrapped", False)
            and "torch.cat((-x2, x1)" in inspect.getsource(rope_utils._rotate_half))


CPU_ROPE = [
    Patch("RoPE without cats",
          "rope_utils._apply_rotary_pos_emb_bshd (RoPE without TE's fused kernel) "
          "concatenates the rotated halves and the empty pass-through part: copies "
          "forward and backward for q and k in every layer.",
          _rope_without_cats, _rope_concatenates),
]
