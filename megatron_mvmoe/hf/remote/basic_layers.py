"""The small modules MVMoEForCausalLM's attention, dense MLPs and MoE layers share
(trust_remote_code; imports only torch and the sibling quantize.py).

Design choices:
- Megatron's SwiGLU fc1 ([gate; up]) stays fused: BitNet's absmean scale spans exactly the
  matrix Megatron quantizes.
- A separate file so moe_layers.py and modeling_mvmoe.py both import these without
  importing each other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_mvmoe import MVMoEConfig
from .quantize import bitlinear_input, quantize_weight_ste


def bitnet_bits(config: MVMoEConfig) -> Optional[int]:
    return config.bitnet_activation_bits if config.bitnet else None


class Linear(nn.Module):
    """Bias-free linear, weight [out, in]; a BitNet b1.58 linear when `bits` is set."""

    def __init__(self, in_size: int, out_size: int, bits: Optional[int] = None,
                 input_norm: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_size, in_size))
        self.bits, self.input_norm = bits, input_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits is None:
            return F.linear(x, self.weight)
        return F.linear(bitlinear_input(x, self.bits, self.input_norm),
                        quantize_weight_ste(self.weight))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    """Megatron's MLP with gated_linear_unit: fc1 = [gate; up] rows, silu(gate) * up, fc2."""

    def __init__(self, in_size: int, width: int, config: MVMoEConfig) -> None:
        super().__init__()
        bits, norm = bitnet_bits(config), config.bitnet_input_norm
        self.linear_fc1 = Linear(in_size, 2 * width, bits, norm)
        self.linear_fc2 = Linear(width, in_size, bits, norm)

    def forward(self, x: torch.Tensor, scale_T: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`scale_T`: the routing gates, applied after the activation as Megatron does."""
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if scale_T is not None:
            hidden = hidden * scale_T.unsqueeze(-1)
        return self.linear_fc2(hidden)


class SharedExpert(SwiGLU):
    """Megatron's SharedExpertMLP: the SwiGLU, times sigmoid(gate_weight . x) when gated."""

    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__(config.hidden_size, config.shared_expert_intermediate_size, config)
        self.gate_weight = (nn.Parameter(torch.empty(1, config.hidden_size))
                            if config.shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.gate_weight))
