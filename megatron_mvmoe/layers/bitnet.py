"""BitNet b1.58 quantization-aware training for linear layers (seed 001, Table 3).

Legend: T tokens (any leading dims), N in-features, M out-features.

Design choices:
- Weights: one absmean scale per matrix, gamma = mean |W|; W_q = RoundClip(W / gamma, -1, 1)
  in {-1, 0, +1}; the matmul uses W_q * gamma. Activations: per-token absmax to signed
  `bits`-bit integers, x_q = RoundClip(x * Q / max|x|, -Q - 1, Q) with Q = 2^(bits-1) - 1,
  dequantized by the same scale. Both follow the BitNet b1.58 recipe.
- Input normalisation: BitNet's BitLinear is y = W_q Quant(RMSNorm(x)); the norm sits inside
  every BitLinear, right before the 8-bit activation quantizer, so each linear's input has
  unit RMS whatever precedes it (attention output projection, fc2 after the activation,
  latent up-projection, MH-MoE merge: none of these follows a block norm). Ours is the
  parameter-free RMSNorm (no gain: parameter counts and checkpoints stay those of the
  full-precision model; the block's own learnable norms stay where Megatron puts them, so
  a linear after a block norm sees its gain, then the per-token re-normalisation).
  `BitNetConfig.input_norm=False` restores quantization of the raw input.
- Straight-through estimator: q(x) + (x - x.detach()): the forward sees the quantized value,
  the backward the identity, so the optimizer updates full-precision latent weights that
  stay the module's parameters (checkpoints, the distributed optimizer, DDP all see them).
- Megatron linears quantize through their `_forward_impl(input, weight, ...)` seam, which
  both ColumnParallelLinear and RowParallelLinear call with the input and weight just before
  the matmul. Overriding it keeps every communication of the stock forward (sequence-parallel
  gather, reduce-scatter, expert comm) untouched.
- Tensor parallelism: a sharded matrix's absmean and a hidden-sharded input row's absmax are
  reduced over the layer's TP group, so a quantized TP=2 layer equals its TP=1 twin.
- `bitnet_spec` swaps Column/RowParallelLinear for the Bit versions in a deep copy of any
  ModuleSpec tree (attention, dense MLP, experts); routers stay full precision, as in
  BitNet (they are not nn.Linear layers of the network's computation path).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mvmoe.layers.builders import is_builder, parts, rebuilt

from megatron_mvmoe.functional.quantize import bitlinear_input, quantize_weight_ste


class BitLinear(torch.nn.Linear):
    """Drop-in `torch.nn.Linear` with BitNet b1.58 weights and int activations.

    `input_norm=True` (default, as BitNet's BitLinear) applies the parameter-free RMS
    normalisation before quantizing the input."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 activation_bits: int = 8, input_norm: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if not 2 <= activation_bits <= 16:
            raise ValueError(f"activation_bits: must be in [2, 16], got {activation_bits}. "
                             "Fix: use 8")
        self.activation_bits = activation_bits
        self.input_norm = input_norm

    def forward(self, x_TN: torch.Tensor) -> torch.Tensor:
        x_TN = bitlinear_input(x_TN, self.activation_bits, self.input_norm)
        return F.linear(x_TN, quantize_weight_ste(self.weight), self.bias)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, activation_bits={self.activation_bits}, "
                f"input_norm={self.input_norm}")


def _activation_bits(config) -> int:
    bitnet = getattr(config, "bitnet", None)
    return bitnet.activation_bits if bitnet is not None else 8


def _input_norm(config) -> bool:
    bitnet = getattr(config, "bitnet", None)
    return bitnet.input_norm if bitnet is not None else True


def _quantized_impl(layer, input_parallel_is_sharded: bool, impl, input, weight, *args,
                    **kwargs):
    """Quantize input and weight, then run Megatron's matmul + communication as is."""
    group = getattr(layer, "tp_group", None)
    weight = quantize_weight_ste(weight, group)
    input = bitlinear_input(input, layer.activation_bits, layer.input_norm,
                            group if input_parallel_is_sharded else None)
    if "gradient_accumulation_fusion" in kwargs:
        # The quantized weight is not the parameter: let autograd carry its gradient to
        # the latent weight (DDP hooks then accumulate it into main_grad).
        kwargs["gradient_accumulation_fusion"] = False
    return impl(input, weight, *args, **kwargs)


class _BitQuantized:
    """Mixin ahead of a Megatron parallel linear: reads the BitNet settings from its config
    and quantizes input and weight around the parent's matmul + communication."""

    input_is_sharded: bool
    """Whether each rank holds a slice of every input row (the RMS and max span TP)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation_bits = _activation_bits(self.config)
        self.input_norm = _input_norm(self.config)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return _quantized_impl(self, self.input_is_sharded, super()._forward_impl, input,
                               weight, *args, **kwargs)


class BitColumnParallelLinear(_BitQuantized, ColumnParallelLinear):
    """Megatron ColumnParallelLinear with BitNet b1.58 quantization (STE, latent weights)."""

    input_is_sharded = False
    """Column input holds whole rows (replicated or sequence-sharded): no reduce."""


class BitRowParallelLinear(_BitQuantized, RowParallelLinear):
    """Megatron RowParallelLinear with BitNet b1.58 quantization (STE, latent weights)."""

    input_is_sharded = True
    """Row input is split along the hidden dim over TP: each row's RMS and max span the
    group."""


BIT_REPLACEMENTS = {ColumnParallelLinear: BitColumnParallelLinear,
                    RowParallelLinear: BitRowParallelLinear, torch.nn.Linear: BitLinear}


def _swap(value):
    """Rebuild a spec tree with Bit classes; copies containers, shares leaves (no deepcopy:
    spec params may hold process groups, which cannot be copied)."""
    if isinstance(value, type):
        return BIT_REPLACEMENTS.get(value, value)
    if isinstance(value, ModuleSpec) or is_builder(value):
        spec = parts(value)
        return rebuilt(value, module=_swap(spec.module), params=spec.params,
                       submodules=_swap(spec.submodules))
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _swap(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


def bitnet_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of `spec` whose Column/RowParallelLinear (and torch Linear) slots are the BitNet
    versions. The input spec, often shared module-level state, is not mutated."""
    return _swap(spec)


def maybe_bitnet_spec(spec: ModuleSpec, config) -> ModuleSpec:
    """`bitnet_spec(spec)` when `config.bitnet.enabled`, else `spec` unchanged."""
    bitnet: Optional[object] = getattr(config, "bitnet", None)
    return bitnet_spec(spec) if bitnet is not None and bitnet.enabled else spec
