"""Small stock Megatron-Core MoE layers and GPT models for foundation and parity tests.

Everything here is Megatron-Core's own code (MoELayer, GPTModel, specs); this module only
picks CPU-friendly configurations and deterministic full-size weights so a layer can be
compared across layouts (each rank slices the same global weights).
"""

from __future__ import annotations

from typing import Dict

import torch
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mvmoe.layers.builders import parts


# fp32, no fusions, no dropout (the CUDA RNG tracker cannot drop out on CPU), CPU init.
CPU_CONFIG_KWARGS = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
    use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
    masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    persist_layer_norm=False,
)

# Sigmoid top-k routing with the aux-loss-free expert bias, alltoall dispatcher, SequentialMLP.
SIGMOID_MOE_KWARGS = dict(
    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=1.0, moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
    moe_router_load_balancing_type="none",
)


def cpu_config(**overrides) -> TransformerConfig:
    """A TransformerConfig that runs on CPU: fp32, no fusions, no dropout, CPU init."""
    return TransformerConfig(**{**CPU_CONFIG_KWARGS, **overrides})


def sigmoid_moe_config(**overrides) -> TransformerConfig:
    """Sigmoid top-k routing with the aux-loss-free expert bias, alltoall dispatcher."""
    return cpu_config(**{**SIGMOID_MOE_KWARGS, **overrides})


def build_stock_moe_layer(config: TransformerConfig, pg_collection) -> MoELayer:
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=False)
    return MoELayer(config=config, submodules=parts(spec).submodules, pg_collection=pg_collection)


def global_moe_weights(config: TransformerConfig, seed: int = 1234) -> Dict[str, torch.Tensor]:
    """Full-size weights for router, every expert, and the expert bias."""
    gen = torch.Generator().manual_seed(seed)
    E, D, F = config.num_moe_experts, config.hidden_size, config.moe_ffn_hidden_size
    fc1_out = 2 * F if config.gated_linear_unit else F
    return {
        "router": torch.randn(E, D, generator=gen) * 0.5,
        "expert_bias": torch.randn(E, generator=gen) * 0.1,
        "fc1": torch.randn(E, fc1_out, D, generator=gen) * 0.2,
        "fc2": torch.randn(E, D, F, generator=gen) * 0.2,
    }


def load_global_moe_weights(layer: MoELayer, weights: Dict[str, torch.Tensor]) -> None:
    """Copy the global weights into this rank's shard (local experts, TP slices)."""
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        layer.router.expert_bias.copy_(weights["expert_bias"])
        for local_idx, expert in enumerate(layer.experts.local_experts):
            global_idx = layer.local_expert_indices[local_idx]
            _copy_tp_slice(expert.linear_fc1.weight, weights["fc1"][global_idx], dim=0)
            _copy_tp_slice(expert.linear_fc2.weight, weights["fc2"][global_idx], dim=1)


def _copy_tp_slice(param: torch.Tensor, full: torch.Tensor, dim: int) -> None:
    size = param.shape[dim]
    parts = full.shape[dim] // size
    if parts == 1:
        param.copy_(full)
        return
    from megatron.core import parallel_state

    rank = parallel_state.get_expert_tensor_parallel_rank()
    param.copy_(full.narrow(dim, rank * size, size))


def gather_expert_grads(layer: MoELayer, num_experts: int) -> Dict[int, torch.Tensor]:
    """fc1 weight gradients of this rank's local experts keyed by global expert id."""
    return {layer.local_expert_indices[i]: e.linear_fc1.weight.grad.detach().clone()
            for i, e in enumerate(layer.experts.local_experts)}
