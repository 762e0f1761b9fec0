"""Naive MH-MoE reference and small CPU configs, for tests and debugging.

Legend: S sequence, B batch, D hidden, H heads, R routed rows (T * H sub-tokens),
E experts, K top-k.

`naive_mh_moe` recomputes a built `MultiHeadMoELayer` from its weights with plain loops
(softmax over all experts, then top-k, gates not renormalised: Megatron's pre-softmax
routing; SwiGLU experts; gate-weighted sum; concatenation in head order; merge; shared
expert). It assumes EP = TP = 1 (every expert local) and Megatron's default TopKRouter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def mh_test_config(heads: int = 2, head: bool = True, merge: bool = True, split: bool = True,
                   experts: int = 4, topk: int = 2, hidden: int = 8, ffn: int = 6,
                   shared: Optional[int] = None, bitnet: bool = False, **overrides):
    """A CPU-friendly MVMoETransformerConfig for an MH-MoE layer (fp32, no fusions)."""
    from megatron_mvmoe.config.transformer_config import (BitNetConfig, MultiHeadConfig,
                                                          MVMoETransformerConfig)

    kwargs = dict(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=2 * hidden,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        persist_layer_norm=False, gated_linear_unit=True, activation_func=F.silu,
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
        moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=True,
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=shared, moe_variant="mh_moe",
        multi_head=MultiHeadConfig(num_heads=heads, head_projection=head,
                                   merge_projection=merge, split_tokens=split),
        bitnet=BitNetConfig(enabled=bitnet),
    )
    kwargs.update(overrides)
    return MVMoETransformerConfig(**kwargs)


def _swiglu(x_RD: torch.Tensor, fc1_W: torch.Tensor, fc2_W: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x_RD @ fc1_W.t(), 2, dim=-1)
    return (F.silu(gate) * up) @ fc2_W.t()


def naive_route(sub_RD: torch.Tensor, router_W: torch.Tensor, topk: int):
    """Softmax over all E, then top-k: (gates_RK, experts_RK)."""
    probs_RE = torch.softmax(sub_RD @ router_W.t(), dim=-1)
    return torch.topk(probs_RE, topk, dim=-1)


def naive_mh_moe(layer, x_SBD: torch.Tensor) -> torch.Tensor:
    """Recompute `layer(x_SBD)[0]` row by row from the layer's weights."""
    s, b, d = x_SBD.shape
    heads = layer.num_heads
    h_SBD = x_SBD @ layer.head.weight.t() if layer.head is not None else x_SBD
    sub_RD = h_SBD.reshape(s * b * heads, d // heads)  # token-major, heads in order
    gates_RK, experts_RK = naive_route(sub_RD, layer.moe.router.weight, layer.moe.router.topk)
    local = layer.moe.experts.local_experts
    rows = []
    for r in range(sub_RD.shape[0]):
        out = torch.zeros_like(sub_RD[r])
        for gate, e in zip(gates_RK[r], experts_RK[r]):
            out = out + gate * _swiglu(sub_RD[r], local[e].linear_fc1.weight,
                                       local[e].linear_fc2.weight)
        rows.append(out)
    y_SBD = torch.stack(rows).reshape(s, b, d)
    if layer.merge is not None:
        y_SBD = y_SBD @ layer.merge.weight.t()
    if layer.shared_experts is not None:
        y_SBD = y_SBD + _swiglu(x_SBD, layer.shared_experts.linear_fc1.weight,
                                layer.shared_experts.linear_fc2.weight)
    return y_SBD
