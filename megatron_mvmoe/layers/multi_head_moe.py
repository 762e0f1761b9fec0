"""MH-MoE layer (seed 001): head projection, H sub-tokens routed independently, merge.

Legend: S sequence, B micro-batch, D hidden size, H MH-MoE heads, T tokens (flattened
[S, B] order), E experts.

Flow: shared expert on x_SBD (full D, optional) | head: x_SBD @ W_head (D x D) | split:
[S, B, D] -> [S, B*H, D/H] (sub-token h of token (s, b) is column b*H + h, so the H
sub-tokens of a token are adjacent and keep their order) | a stock Megatron MoELayer whose
config copy has hidden_size = D/H (router, alltoall dispatcher, expert parallelism, experts
of width D/H: all Megatron's) | concatenate: [S, B*H, D/H] -> [S, B, D] | merge: @ W_merge
(D x D) | + shared expert. Returns (output, None) like Megatron MLPs.

Design choices:
- Composition, not a MoELayer subclass: the routed part IS a stock MoELayer (state-dict
  names `moe.router.weight`, `moe.experts.local_experts.<i>...`), so H = 1 without head and
  merge is exactly Megatron's SMoE. Cost: TransformerLayer's `is_moe_layer` is False for
  this layer, which only matters for MoE recompute and CUDA graphs (both unsupported here).
- Switches come from `config.multi_head`: head_projection, merge_projection, split_tokens
  (False routes whole tokens: Table 4's "SMoE with head and merge").
- Head/merge are bias-free and replicated across TP: with sequence parallelism each TP
  rank holds different tokens, so the weights carry Megatron's `sequence_parallel` flag and
  their grads are all-reduced over TP by finalize_model_grads. With `config.bitnet.enabled`
  they quantize (ternary weights, int activations, STE) like every other linear.
- The shared expert (`moe_shared_expert_intermediate_size`) runs on the full D-wide token,
  outside the sub-token MoE, and is added after the merge (Table 2).
- Process groups are passed explicitly: TransformerLayer calls the MLP builder with
  `pg_collection=` (Megatron 0.19.2 builders), and the layer hands them to its inner MoE.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mvmoe.functional.quantize import bitlinear_input, quantize_weight_ste
from megatron_mvmoe.layers.bitnet import maybe_bitnet_spec
from megatron_mvmoe.layers.builders import as_builder, build, parts
from megatron_mvmoe.errors import require


@dataclass
class MultiHeadMoESubmodules:
    """What a MultiHeadMoELayer is built from."""

    moe: Union[ModuleSpec, type] = None
    """Megatron's MoE spec (MoELayer + MoESubmodules); built with the D/H config copy."""
    shared_experts: Union[ModuleSpec, type, None] = None
    """Megatron's SharedExpertMLP spec; built with the full-D config when the config sets
    moe_shared_expert_intermediate_size."""


class ReplicatedProjection(MegatronModule):
    """Bias-free D x D projection, replicated across TP; BitNet-quantized when enabled."""

    def __init__(self, config, init_method) -> None:
        super().__init__(config)
        size = config.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(size, size, dtype=torch.float32))
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.data = self.weight.data.to(config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        bitnet = getattr(config, "bitnet", None)
        self.bitnet_bits = bitnet.activation_bits if bitnet is not None and bitnet.enabled \
            else None
        self.bitnet_input_norm = bool(self.bitnet_bits) and bitnet.input_norm

    def forward(self, x_SBD: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.bitnet_bits is not None:
            x_SBD = bitlinear_input(x_SBD, self.bitnet_bits, self.bitnet_input_norm)
            weight = quantize_weight_ste(weight)
        return F.linear(x_SBD, weight)


def sub_token_config(config):
    """A copy of `config` in which the routed MoE sees sub-tokens of D / H, has no shared
    expert (it runs outside on full D) and is a plain SMoE."""
    heads = config.multi_head.num_heads if config.multi_head.split_tokens else 1
    inner = copy.deepcopy(config)
    inner.hidden_size = config.hidden_size // heads
    inner.moe_shared_expert_intermediate_size = None
    if hasattr(inner, "moe_variant"):
        inner.moe_variant = "smoe"
    return inner


class MultiHeadMoELayer(MegatronModule):
    """MH-MoE: head projection, split into H sub-tokens, stock MoELayer on D/H, merge."""

    def __init__(self, config, submodules: MultiHeadMoESubmodules,
                 layer_number: Optional[int] = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None) -> None:
        super().__init__(config)
        require(pg_collection is not None, "pg_collection",
                "MultiHeadMoELayer needs its process groups passed explicitly",
                "build it from a decoder-block spec (TransformerLayer passes pg_collection)")
        mh = config.multi_head
        self.num_heads = mh.num_heads if mh.split_tokens else 1
        self.layer_number = layer_number
        self.head = ReplicatedProjection(config, config.init_method) \
            if mh.head_projection else None
        self.moe = build(submodules.moe, config=sub_token_config(config),
                         layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer,
                         name=(name + ".moe") if name is not None else None)
        self.merge = ReplicatedProjection(config, config.output_layer_init_method) \
            if mh.merge_projection else None
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build(
                submodules.shared_experts, config=config, pg_collection=pg_collection,
                gate=config.moe_shared_expert_gate,
                name=(name + ".shared_experts") if name is not None else None)

    def set_layer_number(self, layer_number: int) -> None:
        """Called by TransformerLayer; the inner MoELayer's router logs aux losses by it."""
        self.layer_number = layer_number
        self.moe.set_layer_number(layer_number)

    # ---- named steps --------------------------------------------------------------------
    def split(self, x_SBD: torch.Tensor) -> torch.Tensor:
        """[S, B, D] -> [S, B*H, D/H]: sub-token h of token (s, b) at column b*H + h."""
        s, b, d = x_SBD.shape
        return x_SBD.reshape(s, b * self.num_heads, d // self.num_heads)

    def concatenate(self, sub_SbH: torch.Tensor, batch: int) -> torch.Tensor:
        """[S, B*H, D/H] -> [S, B, D], sub-tokens back in their original order."""
        s = sub_SbH.shape[0]
        return sub_SbH.reshape(s, batch, -1)

    def split_padding_mask(self, padding_mask_BS: Optional[torch.Tensor]):
        """[B, S] (True = padding) -> [B*H, S]: each sub-token inherits its token's flag."""
        if padding_mask_BS is None:
            return None
        return padding_mask_BS.repeat_interleave(self.num_heads, dim=0)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                **kwargs):
        """hidden_states [S, B, D] -> (output [S, B, D], None)."""
        x_SBD = hidden_states
        shared_SBD = self.shared_experts(x_SBD) if self.shared_experts is not None else None
        if self.head is not None:
            x_SBD = self.head(x_SBD)
        routed, bias = self.moe(self.split(x_SBD),
                                padding_mask=self.split_padding_mask(padding_mask))
        assert bias is None, "Megatron's MoELayer returns no bias"
        y_SBD = self.concatenate(routed, x_SBD.shape[1])
        if self.merge is not None:
            y_SBD = self.merge(y_SBD)
        if shared_SBD is not None:
            y_SBD = y_SBD + shared_SBD
        return y_SBD, None


def mh_moe_spec(config, moe_spec=None):
    """MLP builder for an MoE slot of a decoder-block spec (replaces the MoE MLP).

    `moe_spec` (Megatron's MoE builder) defaults to the local (non-TE) one for the config;
    BitNet linears are swapped in when `config.bitnet.enabled`."""
    if moe_spec is None:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        moe_spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                                       moe_grouped_gemm=config.moe_grouped_gemm)
    moe_spec = maybe_bitnet_spec(moe_spec, config)
    submodules = MultiHeadMoESubmodules(
        moe=moe_spec, shared_experts=parts(moe_spec).submodules.shared_experts)
    return as_builder(MultiHeadMoELayer, submodules=submodules)
