"""BitNet b1.58 quantizers (seed 001): absmean ternary weights, per-token absmax int
activations, BitLinear's parameter-free input RMSNorm, straight-through estimators. Pure
torch (torch.distributed only to span a tensor-parallel shard); layers/bitnet.py puts them
into Megatron's linears.

Legend: M, N matrix dims; T tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

EPS = 1e-5
"""Floor on scales: an all-zero matrix or token quantizes to zeros instead of NaN."""
NORM_EPS = 1e-5
"""RMSNorm epsilon inside BitLinear (Megatron's default layernorm_epsilon)."""


def _group_size(group) -> int:
    return group.size() if group is not None and dist.is_initialized() else 1


def ternary_weight(weight_MN: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to {-1, 0, +1} with one absmean scale; returns (W_q, gamma).

    With a TP group, the mean runs over the whole (sharded) matrix."""
    with torch.no_grad():
        abs_sum = weight_MN.abs().sum().float()
        count = torch.tensor(float(weight_MN.numel()), device=weight_MN.device)
        if _group_size(group) > 1:
            stats = torch.stack([abs_sum, count])
            dist.all_reduce(stats, group=group)
            abs_sum, count = stats[0], stats[1]
        gamma = (abs_sum / count).clamp(min=EPS).to(weight_MN.dtype)
    ternary_MN = (weight_MN / gamma).round().clamp(-1, 1)
    return ternary_MN, gamma


def absmax_activation(x_TN: torch.Tensor, bits: int = 8,
                      group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each token (last dim) to signed `bits`-bit integers; returns (x_int, scale_T1)
    with x ~= x_int / scale. With a TP group, the max runs over the whole (sharded) row."""
    q = 2 ** (bits - 1) - 1
    with torch.no_grad():
        absmax_T1 = x_TN.abs().amax(dim=-1, keepdim=True).float()
        if _group_size(group) > 1:
            dist.all_reduce(absmax_T1, op=dist.ReduceOp.MAX, group=group)
        scale_T1 = (q / absmax_T1.clamp(min=EPS)).to(x_TN.dtype)
    x_int_TN = (x_TN * scale_T1).round().clamp(-q - 1, q)
    return x_int_TN, scale_T1


def rms_normalize(x_TN: torch.Tensor, group=None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim, x / sqrt(mean(x^2) + eps), differentiable.

    With a TP group the last dim is sharded: the sum of squares is all-reduced (with the
    autograd-aware all_reduce, whose backward sums the gradients over the group too), so
    each shard is normalised by the RMS of the whole row."""
    x = x_TN.float()
    sum_sq_T1 = x.pow(2).sum(dim=-1, keepdim=True)
    width = x.shape[-1]
    if _group_size(group) > 1:
        from torch.distributed.nn.functional import all_reduce

        sum_sq_T1 = all_reduce(sum_sq_T1, group=group)
        width *= group.size()
    return (x * torch.rsqrt(sum_sq_T1 / width + NORM_EPS)).to(x_TN.dtype)


def bitlinear_input(x_TN: torch.Tensor, bits: int = 8, input_norm: bool = True,
                    group=None) -> torch.Tensor:
    """What a BitLinear multiplies: Quant_bits(RMSNorm(x)) (STE), or Quant_bits(x) without
    the norm. `group`: the TP group when the last dim is sharded over it, else None."""
    if input_norm:
        x_TN = rms_normalize(x_TN, group)
    return quantize_activation_ste(x_TN, bits, group)


def straight_through(x: torch.Tensor, x_quantized: torch.Tensor) -> torch.Tensor:
    """Forward value exactly x_quantized, gradient of the identity w.r.t. x.

    Written q + (x - x) rather than the usual x + (q - x): the latter rounds, so quantized
    weights would not be exactly three values times one scale."""
    return x_quantized.detach() + (x - x.detach())


def quantize_weight_ste(weight_MN: torch.Tensor, group=None) -> torch.Tensor:
    """W_q * gamma in the forward, identity gradient to the latent weight."""
    ternary_MN, gamma = ternary_weight(weight_MN, group)
    return straight_through(weight_MN, ternary_MN * gamma)


def quantize_activation_ste(x_TN: torch.Tensor, bits: int = 8, group=None) -> torch.Tensor:
    """Dequantized int activations in the forward, identity gradient to x."""
    x_int_TN, scale_T1 = absmax_activation(x_TN, bits, group)
    return straight_through(x_TN, x_int_TN / scale_T1)
