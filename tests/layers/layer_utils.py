"""Shared builders for the layer tests: tiny CPU configs, layers from the variant specs,
and layout-independent global weights (each rank copies its shard)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.models.specs import build_moe_layer
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.stock_moe import CPU_CONFIG_KWARGS, SIGMOID_MOE_KWARGS

SEQ, BATCH = 6, 2
LATENT_VARIANTS = ("latent", "multi_router", "multi_view")
"""The variants that route latent tokens (what the all-to-all tests compare)."""


def mv_config(variant: str = "multi_view", num_routers: int = 2, ramp_steps: int = 0,
              stop_grad_mixing: bool = False, kernels: str = "auto",
              **overrides) -> MVMoETransformerConfig:
    """A tiny fp32 CPU config for any variant (sigmoid + expert bias, alltoall)."""
    num_views = num_routers if variant == "multi_view" else 1
    base = {**CPU_CONFIG_KWARGS, **SIGMOID_MOE_KWARGS}
    base.update(
        moe_router_topk=3, moe_ffn_hidden_size=24, moe_variant=variant, latent_size=16,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=num_views,
                                   gamma_ramp_steps=ramp_steps,
                                   stop_grad_mixing=stop_grad_mixing, view_init_std=0.3,
                                   kernels=kernels),
    )
    base.update(overrides)
    return MVMoETransformerConfig(**base)


def build_layer(config, pg_collection):
    """The variant's MoE layer, built from the same spec the decoder block uses."""
    return build_moe_layer(config, pg_collection)


def init_ep_layout(world_size: int):
    """Megatron's groups for EP = world size (every rank holds a slice of the experts)."""
    return initialize_layout(ParallelLayout(ep=world_size))


def ep_layer(variant: str, pg_collection, world_size: int, **overrides) -> Tuple:
    """(config, layer): the variant's tiny layer on this rank of an EP = `world_size` group,
    loaded with the layout-independent `global_weights` (one router for the latent
    baseline, two otherwise, unless `num_routers` is given)."""
    overrides.setdefault("num_routers", 1 if variant == "latent" else 2)
    config = mv_config(variant, expert_model_parallel_size=world_size, **overrides)
    layer = build_layer(config, pg_collection)
    load_global_weights(layer, global_weights(config))
    return config, layer


def global_weights(config, seed: int = 1234) -> Dict[str, torch.Tensor]:
    """Full-size weights for every parameter family of the latent variants."""
    gen = torch.Generator().manual_seed(seed)
    mv = config.multi_view
    E, D, L, F = (config.num_moe_experts, config.hidden_size, config.latent_size,
                  config.moe_ffn_hidden_size)
    R = mv.num_routers
    return {
        "router": torch.randn(R * E, D, generator=gen) * 0.5,
        "expert_bias": torch.randn(E, generator=gen) * 0.1,
        "fc1": torch.randn(E, F, L, generator=gen) * 0.3,
        "fc2": torch.randn(E, L, F, generator=gen) * 0.3,
        "down": torch.randn(L, D, generator=gen) * 0.3,
        "up": torch.randn(D, L, generator=gen) * 0.3,
        "dP": torch.randn(max(mv.num_views - 1, 0), L, D, generator=gen) * 0.3,
    }


def load_global_weights(layer, weights: Dict[str, torch.Tensor]) -> None:
    """Copy the global weights into this rank's layer (local experts, whole projections)."""
    with torch.no_grad():
        rows = layer.router.weight.shape[0]
        layer.router.weight.copy_(weights["router"][:rows])
        layer.router.expert_bias.copy_(weights["expert_bias"])
        for local_idx, expert in enumerate(layer.experts.local_experts):
            global_idx = layer.local_expert_indices[local_idx]
            expert.linear_fc1.weight.copy_(weights["fc1"][global_idx])
            expert.linear_fc2.weight.copy_(weights["fc2"][global_idx])
        layer.fc1_latent_proj.weight.copy_(weights["down"])
        layer.fc2_latent_proj.weight.copy_(weights["up"])
        perturb = getattr(layer.fc1_latent_proj, "view_perturbations", None)
        if perturb is not None and perturb.numel():
            perturb.copy_(weights["dP"])


def global_input(hidden: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, hidden, generator=torch.Generator().manual_seed(seed))


def named_grads(layer) -> Dict[str, torch.Tensor]:
    """Grads of the non-expert parameters, and the experts' keyed by global expert id."""
    grads = {}
    for name, param in layer.named_parameters():
        if param.grad is None:
            continue
        if ".local_experts." in name:
            local = int(name.split(".local_experts.")[1].split(".")[0])
            rest = name.split(".local_experts.")[1].split(".", 1)[1]
            name = f"experts.{layer.local_expert_indices[local]}.{rest}"
        grads[name] = param.grad.detach().clone()
    return grads
