"""Latent MoE on Megatron-Core without TransformerEngine: `LatentMoELayer(MoELayer)`.

Legend: T tokens (flattened [S, B] order), D hidden size, L latent size, E experts,
S selected slots per token (top-k).

Flow (seed 000, Eq. 1), one named phase each, everything else is Megatron's MoELayer:
  shared expert (full D) | route (router on full D) | preprocess: z = P h (D -> L), then the
  dispatcher's permute | dispatch (all-to-all of L-sized rows) | experts R^L -> R^L |
  combine | postprocess: unpermute, up-projection (L -> D), + shared expert.

Design choices:
- The latent size is our `config.latent_size`, never Megatron's `moe_latent_size`: 0.19.2
  still asserts TransformerEngine on that path (`moe_layer.py:266`). One code path on CPU and GPU keeps layouts and
  devices comparable; TE could be delegated to later without changing the phases.
- Experts are built from the layer's own experts spec with an L-sized config copy
  (`hidden_size = L`) through a tiny builder seam (`experts_in_latent_space`), so
  SequentialMLP / TEGroupedMLP run unchanged in latent space, and parameter names stay
  Megatron's (`experts.local_experts.<i>.linear_fc1.weight`).
- The projections are bias-free and replicated across TP (not split): with sequence
  parallelism each TP rank sees different tokens, so the weights carry Megatron's
  `sequence_parallel` attribute and finalize_model_grads all-reduces their grads over TP.
  Names follow Megatron's (`fc1_latent_proj.weight` [L, D], `fc2_latent_proj.weight` [D, L]).
  With `config.bitnet.enabled` they quantize (ternary weights, int activations, STE).
- The router is whatever the spec gives (`MoESubmodules.router`): Megatron's TopKRouter
  with sigmoid + expert bias for the baseline, `MultiRouter` for the Multi-Router variant.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron_mvmoe.functional.quantize import bitlinear_input, quantize_weight_ste
from megatron_mvmoe.layers.builders import as_builder, build


def latent_expert_config(config):
    """A copy of `config` in which the experts' model width is the latent size L."""
    expert_config = copy.deepcopy(config)
    expert_config.hidden_size = config.latent_size
    return expert_config


def experts_in_latent_space(num_local_experts, config, experts_spec=None, pg_collection=None,
                            name=None):
    """Experts builder seam: MoELayer calls `experts(n, config, pg_collection=, name=)`;
    this builds the wrapped experts builder (SequentialMLP, TEGroupedMLP, ...) with
    `latent_expert_config(config)`, so no wrapper module appears in the state dict."""
    return build(experts_spec, num_local_experts, latent_expert_config(config),
                 pg_collection=pg_collection, name=name)


class LatentProjection(torch.nn.Module):
    """Bias-free linear map replicated across TP ranks: weight [out, in]. With
    `config.bitnet.enabled` it is a BitNet b1.58 linear (ternary weight, int activations,
    STE), like every Column/RowParallelLinear of the block."""

    def __init__(self, in_size: int, out_size: int, config, init_method) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_size, in_size, dtype=torch.float32))
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.data = self.weight.data.to(config.params_dtype)
        # replicated over TP: with SP the grads must be all-reduced across TP ranks
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.bitnet_bits = bitnet_activation_bits(config)
        self.bitnet_input_norm = config.bitnet.input_norm if self.bitnet_bits else False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bitnet_bits is None:
            return torch.nn.functional.linear(x, self.weight)
        x = bitlinear_input(x, self.bitnet_bits, self.bitnet_input_norm)
        return torch.nn.functional.linear(x, quantize_weight_ste(self.weight))


def bitnet_activation_bits(config) -> Optional[int]:
    """The activation bits when `config.bitnet.enabled`, else None (full precision)."""
    bitnet = getattr(config, "bitnet", None)
    return bitnet.activation_bits if bitnet is not None and bitnet.enabled else None


def latent_submodules(submodules: MoESubmodules) -> MoESubmodules:
    """The same submodules with the experts built in latent space (a new object)."""
    experts = as_builder(experts_in_latent_space, experts_spec=submodules.experts)
    return replace(submodules, experts=experts)


class LatentMoELayer(MoELayer):
    """Megatron MoELayer whose routed experts run on latent rows z = P h."""

    def __init__(self, config, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None) -> None:
        assert config.latent_size, "MVMoETransformerConfig validates latent_size"
        super().__init__(config=config, submodules=latent_submodules(submodules),
                         layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        self.latent_size = config.latent_size
        self.fc1_latent_proj = self.build_down_projection(config)
        self.fc2_latent_proj = LatentProjection(
            config.latent_size, config.hidden_size, config, config.output_layer_init_method)

    def build_down_projection(self, config) -> torch.nn.Module:
        """P: D -> L (the Multi-View layer overrides this with its K views)."""
        return LatentProjection(config.hidden_size, config.latent_size, config,
                                config.init_method)

    # ---- named phases -----------------------------------------------------------------
    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor):
        """Down-project to the latent space, then the dispatcher's permute."""
        latent = self.fc1_latent_proj(hidden_states)
        return self.token_dispatcher.dispatch_preprocess(latent, routing_map, probs)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """Unpermute (scatter-add of gated rows), up-project L -> D, add the shared expert."""
        output = self.token_dispatcher.combine_postprocess(output)
        output = self.fc2_latent_proj(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output
