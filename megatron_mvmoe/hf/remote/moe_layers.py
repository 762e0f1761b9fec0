"""MVMoEForCausalLM's MoE layers: Megatron's TopKRouter, our MultiRouter and Multi-View
projection, the experts, and MH-MoE around them (trust_remote_code).

Legend: T tokens, D hidden size, E experts, R routing heads (= views), N slots per token
(top-k), L width an expert sees (D, D/heads for MH-MoE, or the latent size).

Design choices:
- Megatron's TopKRouter (smoe, latent, the MH-MoE inner router) is written out here (softmax
  over the top-k logits, or sigmoid + expert bias normalised over the selection); the
  Multi-Router and Multi-View routing use functional's select_topk / gates / mixing_weights
  (routing.py, mixing.py, copied beside this file by the exporter).
- Experts run on one row per (token, slot): the token itself, its latent z = P h, or its
  Multi-View blend (functional.mixing.blend_views); gated outputs are summed per token in
  Megatron's expert-major order.
- Group-limited routing is Megatron's group_limited_topk, written out below.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .basic_layers import Linear, SharedExpert, SwiGLU, bitnet_bits
from .configuration_mvmoe import MVMoEConfig
from .mixing import blend_views, mixing_weights
from .quantize import bitlinear_input, quantize_weight_ste
from .routing import gates, multi_router_logits, select_topk, sigmoid_scores, sum_over_routers


def group_limited_topk(scores_TE: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Megatron's moe_utils.group_limited_topk: keep the group_topk groups whose top
    (topk / group_topk) scores sum highest, then top-k among their experts."""
    t, e = scores_TE.shape
    group_scores_TG = scores_TE.view(t, num_groups, -1).topk(topk // group_topk,
                                                             dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores_TG, k=group_topk, dim=-1, sorted=False)[1]
    group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1)
    score_mask_TE = group_mask_TG.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    masked_TE = scores_TE.masked_fill(~score_mask_TE.bool(), float("-inf"))
    return torch.topk(masked_TE, k=topk, dim=-1)


def _topk(scores_TE: torch.Tensor, topk: int, config: MVMoEConfig):
    """(values, indices): group-limited when the model was trained so, else torch.topk."""
    if config.router_group_topk:
        return group_limited_topk(scores_TE, topk, config.router_num_groups,
                                  config.router_group_topk)
    return torch.topk(scores_TE, topk, dim=1)


class Experts(nn.Module):
    """Megatron's SequentialMLP (`experts.local_experts.<e>`), run on per-slot rows."""

    def __init__(self, width_in: int, config: MVMoEConfig) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(
            SwiGLU(width_in, config.moe_intermediate_size, config)
            for _ in range(config.num_experts))

    def forward(self, rows_TNL, topk_idx_TN, gates_TN) -> torch.Tensor:
        """sum over slots of expert(row, gate), accumulated expert by expert."""
        out_TL = rows_TNL.new_zeros(rows_TNL.shape[0], rows_TNL.shape[2])
        for expert_id, expert in enumerate(self.local_experts):
            token_ids, slot_ids = torch.where(topk_idx_TN == expert_id)
            if token_ids.numel() == 0:
                continue
            y = expert(rows_TNL[token_ids, slot_ids], gates_TN[token_ids, slot_ids])
            out_TL.index_add_(0, token_ids, y)
        return out_TL


class TopKRouter(nn.Module):
    """Megatron's TopKRouter forward (topk_routing_with_score_function, unfused)."""

    def __init__(self, width_in: int, config: MVMoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, width_in))
        self.topk = config.num_experts_per_tok
        self.score_function = config.router_score_function
        self.pre_softmax = config.router_pre_softmax
        self.scaling = config.router_topk_scaling_factor
        self.config = config
        if config.router_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x_TD: torch.Tensor):
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, idx = _topk(torch.softmax(logits_TE, dim=-1), self.topk, self.config)
            else:
                top, idx = _topk(logits_TE, self.topk, self.config)
                probs = torch.softmax(top, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
            choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
            idx = _topk(choice_TE, self.topk, self.config)[1]
            probs = scores_TE.gather(1, idx)
            if self.topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling:
            probs = probs * self.scaling
        return idx, probs.to(x_TD.dtype), None


class MultiRouter(nn.Module):
    """megatron_mvmoe's MultiRouter: R sigmoid heads summed after the sigmoid (Eq. 2-4)."""

    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__()
        self.num_routers, self.num_experts = config.num_routers, config.num_experts
        self.weight = nn.Parameter(torch.empty(self.num_routers * self.num_experts,
                                               config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        self.gate_scale = (nn.Parameter(torch.full((config.num_experts,), config.gate_scale))
                           if config.learned_gate_scale else float(config.gate_scale))
        self.topk, self.eps = config.num_experts_per_tok, config.normalizer_eps
        self.num_views = config.num_views
        self.config = config

    def _select(self, summed_TE: torch.Tensor) -> torch.Tensor:
        """routing/router.py's MultiRouter._select: ascending expert ids per token."""
        if not self.config.router_group_topk:
            return select_topk(summed_TE, self.expert_bias, self.topk)
        idx_TN = _topk(summed_TE + self.expert_bias, self.topk, self.config)[1]
        return torch.sort(idx_TN, dim=-1).values

    def forward(self, x_TD: torch.Tensor):
        weight_RED = self.weight.view(self.num_routers, self.num_experts, -1)
        scores_TRE = sigmoid_scores(multi_router_logits(x_TD, weight_RED, torch.float32))
        summed_TE = sum_over_routers(scores_TRE)
        idx_TN = self._select(summed_TE)
        gates_TN = gates(summed_TE, idx_TN, self.gate_scale, self.eps, self.num_routers)
        mix_TNR = mixing_weights(scores_TRE, idx_TN) if self.num_views > 1 else None
        return idx_TN, gates_TN.to(x_TD.dtype), mix_TNR


class ViewProjection(nn.Module):
    """fc1_latent_proj of the Multi-View layer: view 0 = P h, view m = (P + gamma dP_m) h."""

    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__()
        shape_LD = (config.latent_size, config.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape_LD))
        self.view_perturbations = nn.Parameter(torch.empty(config.num_views - 1, *shape_LD))
        self.bits, self.input_norm = bitnet_bits(config), config.bitnet_input_norm

    def forward(self, x_TD: torch.Tensor, gamma: float) -> torch.Tensor:
        """views_TRL (views.projections.MultiViewProjection's arithmetic)."""
        num_views, latent = self.view_perturbations.shape[0] + 1, self.weight.shape[0]
        if self.bits is not None:
            x_TD = bitlinear_input(x_TD, self.bits, self.input_norm)
            weights = torch.cat([self.weight.unsqueeze(0),
                                 self.weight.unsqueeze(0) + gamma * self.view_perturbations])
            quantized_XD = torch.stack([quantize_weight_ste(w) for w in weights]).flatten(0, 1)
            return F.linear(x_TD, quantized_XD).unflatten(-1, (num_views, latent))
        backbone_T1L = F.linear(x_TD, self.weight).unsqueeze(-2)
        perturb_TX = F.linear(x_TD, self.view_perturbations.reshape(-1, x_TD.shape[-1]))
        perturb_TML = perturb_TX.unflatten(-1, (num_views - 1, latent))
        return torch.cat([backbone_T1L, backbone_T1L + gamma * perturb_TML], dim=-2)


MOE_STRUCTURES = {"smoe": (False, False, False), "latent": (True, False, False),
                  "multi_router": (True, True, False), "multi_view": (True, True, True)}
"""moe_variant -> (experts on a latent, Multi-Router heads, views mixed) of `MoE`; "mh_moe"
is `MultiHeadMoE` around an smoe `MoE`, "dense" has no MoE layer. The exporter writes one
of these (the variant record's hf_structure); any other is refused by `build_mlp`."""


class MoE(nn.Module):
    """Routed experts on D (smoe), on a latent L (latent, multi_router) or on Multi-View
    blends (multi_view), plus the optional shared expert on the full hidden state."""

    def __init__(self, config: MVMoEConfig, width_in: Optional[int] = None,
                 shared: bool = True, structure: Optional[str] = None) -> None:
        super().__init__()
        width_in = width_in or config.hidden_size
        self.latent, multi_router, self.multi_view = MOE_STRUCTURES[
            structure or config.moe_variant]
        self.gamma = config.gamma
        bits, norm = bitnet_bits(config), config.bitnet_input_norm
        if self.multi_view:
            self.register_buffer("gamma_ramp_state", torch.tensor(
                [config.gamma_ramp_steps, config.gamma_step], dtype=torch.int64))
        self.router = MultiRouter(config) if multi_router else TopKRouter(width_in, config)
        expert_width = config.latent_size if self.latent else width_in
        self.experts = Experts(expert_width, config)
        if self.latent:
            self.fc1_latent_proj = (ViewProjection(config) if self.multi_view else
                                    Linear(config.hidden_size, config.latent_size, bits, norm))
            self.fc2_latent_proj = Linear(config.latent_size, config.hidden_size, bits, norm)
        self.shared_experts = None
        if shared and config.shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(config)

    def expert_rows(self, x_TD, idx_TN, mix_TNR) -> torch.Tensor:
        """rows_TNL: what the expert of each slot sees."""
        t, n = idx_TN.shape
        if self.multi_view:
            views_TRL = self.fc1_latent_proj(x_TD, self.gamma)
            if mix_TNR is None:
                return views_TRL[:, :1, :].expand(t, n, views_TRL.shape[-1])
            return blend_views(views_TRL, mix_TNR)
        rows_TL = self.fc1_latent_proj(x_TD) if self.latent else x_TD
        return rows_TL.unsqueeze(1).expand(t, n, rows_TL.shape[-1])

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        idx_TN, gates_TN, mix_TNR = self.router(x_TD)
        out = self.experts(self.expert_rows(x_TD, idx_TN, mix_TNR), idx_TN, gates_TN)
        if self.latent:
            out = self.fc2_latent_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_TD)
        return out


class MultiHeadMoE(nn.Module):
    """MH-MoE (layers/multi_head_moe.py): head projection, H sub-tokens of D/H through a
    stock SMoE (`moe.`), concatenate, merge projection, + shared expert on full D."""

    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__()
        self.heads = config.mh_num_heads
        bits, norm, d = bitnet_bits(config), config.bitnet_input_norm, config.hidden_size
        self.head = Linear(d, d, bits, norm) if config.mh_head_projection else None
        self.moe = MoE(config, width_in=d // self.heads, shared=False, structure="smoe")
        self.merge = Linear(d, d, bits, norm) if config.mh_merge_projection else None
        self.shared_experts = (SharedExpert(config)
                               if config.shared_expert_intermediate_size else None)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = self.head(x_TD) if self.head is not None else x_TD
        t, d = y_TD.shape
        y_TD = self.moe(y_TD.reshape(t * self.heads, d // self.heads)).reshape(t, d)
        if self.merge is not None:
            y_TD = self.merge(y_TD)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD


MOE_LAYERS = {"mh_moe": MultiHeadMoE, **{name: MoE for name in MOE_STRUCTURES}}
"""moe_variant -> the MoE layer class of an "moe" layer."""


def build_mlp(config: MVMoEConfig, layer_idx: int) -> nn.Module:
    if config.mlp_layer_types[layer_idx] == "dense":
        return SwiGLU(config.hidden_size, config.intermediate_size, config)
    build = MOE_LAYERS.get(config.moe_variant)
    if build is None:
        raise ValueError(f"moe_variant: this code builds {sorted(MOE_LAYERS)}, not "
                         f"{config.moe_variant!r}. Fix: export the checkpoint with the "
                         "megatron_mvmoe version that knows the variant")
    return build(config)
