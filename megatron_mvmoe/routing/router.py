"""Megatron adapter for the Multi-Router (seed 000, Eq. 2-4): `MultiRouter`.

Legend: T tokens (flattened [S, B] order), D hidden size, E experts, R routing heads,
S selected slots per token (top-k).

Design choices:
- Plugs into Megatron's seam `MoESubmodules.router`: built as
  `MultiRouter(config=..., pg_collection=...)`, called as `router(hidden, padding_mask)` and
  returns Megatron's `(probs_TE, routing_map_TE)`. `route()` returns everything else the
  Multi-View layer needs (slots, gates, mixing weights) in a `RoutingOutput`.
- Not a TopKRouter subclass: that class places weights and buffers with
  the current CUDA device. We subclass MegatronModule (an nn.Module) for its
  dist-checkpointing support; placement follows the module (`model.to(device)`).
- `weight` [R*E, D], head-major: with R = 1 exactly TopKRouter.weight, so weights copy over.
- Expert bias: buffers `expert_bias` (persistent) and `local_tokens_per_expert` with the
  names, dtype and counting rule of TopKRouter (count only when grad is enabled; padding
  excluded), so Megatron's finalize_model_grads `_update_router_expert_bias` (found by
  `hasattr(module, "expert_bias")`) updates ours too. Both are kept fp32, also under
  Float16Module (Megatron keeps only the bias fp32, so its bf16 counts round).
- Aux losses (a mixin, routing/aux_losses.py) are Megatron 0.19.2's family (aux_loss,
  seq_aux_loss, global_aux_loss, z-loss)
  with its coefficients, per-token-loss scaling (x local tokens x TP*CP size), MTP scaling
  and `MoEMetricsTracker` logging, computed on what this router scores: the summed head
  scores in fp32 normalised over the experts and, as Megatron does, the top-k of those
  scores WITHOUT the balancing bias (the bias steers selection only). At R = 1 every loss,
  log and gradient equals TopKRouter's (tests/routing/test_router_megatron.py). They are
  attached with MoEAuxLossAutoScaler to gates_TS, from which probs_TE is built, so the
  backward fires exactly once whichever of the two the layer uses.
- Megatron's `--moe-routing-trace-path` tracer hooks TopKRouter only; `routing/trace.py`
  feeds the tracer's own hook from an observer (the Multi-View layer calls `route()`, not
  `forward`, so forward hooks would miss it), with `topk` and a `gating` that returns the
  per-head logits for logit capture.
- padding_mask follows Megatron's router code: [S, B] bool, True marks PADDING (excluded).
- Group-limited routing (`moe_router_num_groups`, `moe_router_group_topk`; DeepSeek's
  device / node-limited routing): Megatron's own `group_limited_topk` on the summed sigmoid
  scores + expert bias (what selection ranks), so each token's k experts lie in at most
  group_topk groups (a group scores the sum of its top-(k / group_topk) members). At R = 1
  this is TopKRouter's selection. Exact ties then follow torch.topk (Megatron's), not the
  lower-expert-id rule of `select_topk`. The fused Triton selection has no group mask:
  group-limited routing always selects on the torch path.
- Capacity and token dropping (`moe_expert_capacity_factor`, `moe_token_drop_policy`,
  `moe_pad_expert_input_to_capacity`): Megatron's own `apply_router_token_dropping` on
  probs_TE, i.e. the Multi-Router gates g (Eq. 3, from the summed scores). Rule: expert i
  keeps C = ceil(T*k/E * factor) (token, i) rows; "probs" keeps its C largest gates (alpha_i
  is constant within an expert's column, so this ranks s_bar_i / sum_{j in S} s_bar_j),
  "position" keeps C of its rows as torch.topk breaks the 0/1 ties (Megatron's rule: NOT
  necessarily the first C tokens). A dropped row's gate is 0 and the pair leaves the routing
  map (`RoutingOutput.kept_TS` marks the slots kept); gates are not renormalised. With
  padding, the map is Megatron's capacity mask: C rows per expert, the padded ones gate 0.
  Aux losses score the unbiased top-k as before (Megatron: independent of dropping); the
  expert-bias counts are of the final map (Megatron's, padded rows included). At R = 1 all
  of it equals TopKRouter (tests/routing/test_capacity_and_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import mvmoe_kernels
import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    group_limited_topk,
)

from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.functional import (
    gates,
    kept_slots,
    mixing_weights,
    multi_router_logits,
    select_topk,
    sigmoid_scores,
    sum_over_routers,
    to_megatron,
)
from megatron_mvmoe.routing.aux_losses import AUX_TYPES, RouterAuxLosses

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class RoutingOutput:
    """Everything one routing step produces (T flattened in [S, B] order)."""

    probs_TE: torch.Tensor
    """Gates scattered to [T, E], zero off the selection (Megatron's `probs`)."""
    routing_map_TE: torch.Tensor
    """bool [T, E], k Trues per row; its s-th True in row t is slot s (ascending expert id)."""
    topk_idx_TS: torch.Tensor
    """Selected experts [T, S], ascending per row."""
    gates_TS: torch.Tensor
    """Output gates g (Eq. 3) aligned with topk_idx_TS; carries the attached aux losses."""
    mix_TSR: Optional[torch.Tensor]
    """View mixing weights a (Eq. 4) [T, S, R]; None when num_views == 1."""
    scores_TRE: torch.Tensor
    """Per-head sigmoid scores [T, R, E]."""
    logits_TRE: torch.Tensor
    """Per-head logits [T, R, E] (carries the attached z-loss)."""
    aux_loss: Optional[torch.Tensor]
    """Detached sum of the aux and z losses attached this step, for logging; None if none.
    Already in the backward through gates_TS / logits_TRE: never add it to the loss."""
    hidden_TD: Optional[torch.Tensor] = None
    """The routed hidden states [T, D] (observers such as the router trace capture them)."""
    kept_TS: Optional[torch.Tensor] = None
    """bool [T, S]: slot s of token t survived the expert capacity (None when dropless).
    gates_TS are the gates before dropping; probs_TE / routing_map_TE are after."""


class MultiRouter(RouterAuxLosses, MegatronModule):
    """R sigmoid routing heads summed after the sigmoid; top-k on sum + expert bias."""

    def __init__(
        self, config: MVMoETransformerConfig, pg_collection=None, is_mtp_layer: bool = False
    ) -> None:
        super().__init__(config)
        _validate(config)
        self.is_mtp_layer = is_mtp_layer  # Megatron's router attribute (aux-loss logging)
        mv = config.multi_view
        self.num_experts = config.num_moe_experts
        self.num_routers = mv.num_routers
        self.num_views = mv.num_views
        self.observers: List[Callable[[RoutingOutput], None]] = []
        """Called with every RoutingOutput (e.g. the trainer's diversity metrics)."""
        self.topk = config.moe_router_topk
        self.num_groups = config.moe_router_num_groups
        self.group_topk = config.moe_router_group_topk
        self.layer_number = None
        self.router_dtype = _ROUTER_DTYPES[config.moe_router_dtype]
        self.kernel_backend = mvmoe_kernels.backend_at_build(mv.kernels)
        """"triton" (the fused selection, without group-limited routing) or "reference",
        resolved once here (multi_view.kernels, else MVMOE_KERNELS, on this device)."""
        self._set_groups(pg_collection)

        self.weight = torch.nn.Parameter(torch.empty(
            (self.num_routers * self.num_experts, config.hidden_size), dtype=torch.float32))
        self.gate_scale = _make_gate_scale(config)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self._register_expert_bias_buffers()
        self._register_global_aux_buffers()
        self.reset_parameters()

    # ---- construction -------------------------------------------------------------------
    def _set_groups(self, pg_collection) -> None:
        """The caller's groups (Megatron's MoELayer always passes its own); None: one
        process (the HF export and unit tests build a router alone)."""
        self.tp_group = getattr(pg_collection, "tp", None)
        self.tp_cp_group = getattr(pg_collection, "tp_cp", None)
        self.tp_dp_cp_group = getattr(pg_collection, "tp_dp_cp", None)

    def _register_expert_bias_buffers(self) -> None:
        if not self.enable_expert_bias:
            self.expert_bias = None  # Megatron's convention: attribute present, None
            self.local_tokens_per_expert = None
            return
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
            persistent=False)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def _register_global_aux_buffers(self) -> None:
        if self.aux_loss_coeff("global_aux_loss") <= 0:
            self.global_tokens_per_expert = None
            self.ga_steps = None
            self.global_aux_tokens_seen = None
            return
        self.register_buffer(
            "global_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
            persistent=False)
        self.register_buffer("ga_steps", torch.tensor(0.0), persistent=False)
        self.register_buffer("global_aux_tokens_seen", torch.tensor(0.0), persistent=False)

    def reset_parameters(self) -> None:
        """Megatron's router init: config.init_method, then params_dtype; tagged for SP."""
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=self.config.params_dtype)
        setattr(self.weight, "sequence_parallel", self.config.sequence_parallel)
        if isinstance(self.gate_scale, torch.nn.Parameter):
            setattr(self.gate_scale, "sequence_parallel", self.config.sequence_parallel)

    def set_layer_number(self, layer_number: int) -> None:
        """Called by MoELayer; used to log aux losses per layer."""
        self.layer_number = layer_number

    # ---- routing ------------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Megatron's router contract: (probs_TE, routing_map_TE)."""
        out = self.route(hidden, padding_mask)
        return out.probs_TE, out.routing_map_TE

    def route(
        self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
    ) -> RoutingOutput:
        """Route hidden [S, B, D] (or [T, D]); padding_mask [S, B] (or [T]), True = padding."""
        hidden_TD, seq_length, batch_size = _flatten_tokens(hidden)
        valid_T = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
        self._maintain_float32_buffers()

        logits_TRE = multi_router_logits(
            hidden_TD, self.weight.view(self.num_routers, self.num_experts, -1),
            self.router_dtype)
        logits_TRE, z_value = self._attach_z_loss(logits_TRE, valid_T)
        scores_TRE = sigmoid_scores(logits_TRE)
        summed_TE = sum_over_routers(scores_TRE)  # also feeds the aux losses (autograd)
        if self.kernel_backend == "triton" and not self.group_topk:
            topk_idx_TS, gates_TS, mix_TSR = self._fused_select(logits_TRE)
        else:
            topk_idx_TS = self._select(summed_TE)
            gates_TS = gates(summed_TE, topk_idx_TS, self._alpha(),
                             self.config.multi_view.normalizer_eps, self.num_routers)
            mix_TSR = (mixing_weights(scores_TRE, topk_idx_TS) if self.num_views > 1
                       else None)
        gates_TS, aux_value = self._attach_aux_losses(
            gates_TS, self._aux_loss_scores(logits_TRE, summed_TE), valid_T, seq_length,
            batch_size)
        probs_TE, routing_map_TE = to_megatron(gates_TS, topk_idx_TS, self.num_experts)
        probs_TE, routing_map_TE, kept_TS = self._apply_capacity(probs_TE, routing_map_TE,
                                                                 topk_idx_TS)
        self._count_tokens(routing_map_TE, valid_T)
        output = RoutingOutput(probs_TE, routing_map_TE, topk_idx_TS, gates_TS, mix_TSR,
                               scores_TRE, logits_TRE, _sum_or_none(z_value, aux_value),
                               hidden_TD, kept_TS)
        for observe in self.observers:
            observe(output)
        return output

    def _select(self, summed_TE: torch.Tensor) -> torch.Tensor:
        """topk_idx_TS on summed + bias: plain top-k, or Megatron's group-limited top-k."""
        if not self.group_topk:
            return select_topk(summed_TE, self.expert_bias, self.topk)
        with torch.no_grad():
            routing_TE = summed_TE if self.expert_bias is None else summed_TE + self.expert_bias
            _, topk_idx_TS = group_limited_topk(
                routing_TE, self.topk, routing_TE.shape[0], self.num_experts,
                self.num_groups, self.group_topk)
            return torch.sort(topk_idx_TS, dim=-1).values  # the slot contract: ascending

    def _apply_capacity(self, probs_TE, routing_map_TE, topk_idx_TS):
        """Megatron's token dropping on the gates (see the module docstring); kept_TS is
        None when dropless."""
        factor = self.config.moe_expert_capacity_factor
        if factor is None:
            return probs_TE, routing_map_TE, None
        probs_TE, routing_map_TE = apply_router_token_dropping(
            probs_TE, routing_map_TE, router_topk=self.topk, capacity_factor=factor,
            drop_policy=self.config.moe_token_drop_policy,
            pad_to_capacity=self.config.moe_pad_expert_input_to_capacity)
        return probs_TE, routing_map_TE, kept_slots(routing_map_TE, topk_idx_TS)

    def _fused_select(self, logits_TRE: torch.Tensor):
        """Selection, gates and mixing weights in one Triton pass (same math as the torch
        path: mvmoe_kernels' tests compare the two)."""

        bias_E = self.expert_bias if self.enable_expert_bias else None
        out = mvmoe_kernels.fused_multi_router(
            logits_TRE, bias_E, self.topk, self._alpha(),
            self.config.multi_view.normalizer_eps, backend="triton")
        mix_TSR = out.mix_TSR if self.num_views > 1 else None
        return out.topk_idx_TS, out.gates_TS.to(logits_TRE.dtype), mix_TSR

    def _alpha(self) -> Union[float, torch.Tensor]:
        return self.gate_scale if isinstance(self.gate_scale, torch.Tensor) else float(
            self.gate_scale)

    # ---- expert bias --------------------------------------------------------------------
    def _maintain_float32_buffers(self) -> None:
        """Float16Module casts buffers to bf16/fp16: keep the bias and its counts fp32."""
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(self, name, None)
            if buf is not None and buf.dtype != torch.float32:
                buf.data = buf.data.to(torch.float32)

    def _count_tokens(self, routing_map_TE: torch.Tensor, valid_T: Optional[torch.Tensor]):
        """TopKRouter's rule: count only with grad enabled (not in eval under no_grad, nor in
        the no-grad first pass of activation recompute); padding excluded."""
        if not (self.enable_expert_bias and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            if valid_T is not None:
                routing_map_TE = routing_map_TE & valid_T.unsqueeze(-1)
            self.local_tokens_per_expert += routing_map_TE.sum(dim=0)

    def _load_from_state_dict(self, *args, **kwargs):
        self._maintain_float32_buffers()
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs):
        self._maintain_float32_buffers()
        return super()._save_to_state_dict(*args, **kwargs)

    # ---- Megatron router-trace compatibility ---------------------------------------------
    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-head logits [T, R*E] (head-major), what Megatron's tracer captures as logits."""
        hidden_TD, _, _ = _flatten_tokens(hidden)
        logits_TRE = multi_router_logits(
            hidden_TD, self.weight.view(self.num_routers, self.num_experts, -1),
            self.router_dtype)
        return logits_TRE.reshape(hidden_TD.shape[0], -1)


def _validate(config: MVMoETransformerConfig) -> None:
    """Refuse Megatron router features this router does not implement, naming the fix."""
    def refuse(ok: bool, field_name: str, fix: str) -> None:
        if not ok:
            raise ValueError(f"{field_name}: not supported by MultiRouter. Fix: {fix}")

    refuse(config.num_moe_experts is not None, "num_moe_experts", "set the expert count")
    refuse(config.moe_router_score_function == "sigmoid", "moe_router_score_function",
           "set 'sigmoid' (the Multi-Router sums sigmoid scores)")
    if config.moe_router_group_topk:
        per_group = config.num_moe_experts // config.moe_router_num_groups
        refuse(config.moe_router_group_topk * per_group >= config.moe_router_topk,
               "moe_router_group_topk",
               f"allow at least moe_router_topk={config.moe_router_topk} experts: "
               f"group_topk x experts per group = {config.moe_router_group_topk} x "
               f"{per_group} is fewer")
    refuse(config.moe_input_jitter_eps is None, "moe_input_jitter_eps", "leave it None")
    refuse(not config.moe_router_force_load_balancing, "moe_router_force_load_balancing",
           "leave it False")
    refuse(not config.moe_enable_routing_replay, "moe_enable_routing_replay", "leave it False")
    refuse(not config.moe_router_fusion, "moe_router_fusion",
           "leave it False (TE's fused router kernels score one head; with "
           "multi_view.kernels='triton' the Multi-Router has its own fused kernel)")
    refuse(getattr(config, "moe_router_force_biased", None) is None, "moe_router_force_biased",
           "leave it None (it biases TopKRouter's single-head logits for benchmarks)")
    types = config.moe_router_load_balancing_type
    for aux_type in [types] if isinstance(types, str) else types:
        refuse(aux_type in AUX_TYPES + ("none",), "moe_router_load_balancing_type",
               f"use one of {AUX_TYPES + ('none',)} (got {aux_type!r}; sinkhorn and "
               "quantile_balancing replace top-k selection, which the Multi-Router defines)")
    scaling = config.moe_router_topk_scaling_factor
    refuse(scaling is None or scaling == config.multi_view.gate_scale,
           "moe_router_topk_scaling_factor",
           f"set multi_view.gate_scale (alpha) instead, or make both equal ({scaling} != "
           f"{config.multi_view.gate_scale})")


def _make_gate_scale(config: MVMoETransformerConfig):
    """alpha: a float, or a learned per-expert parameter initialised to gate_scale."""
    mv = config.multi_view
    if not mv.learned_gate_scale:
        return mv.gate_scale
    return torch.nn.Parameter(torch.full((config.num_moe_experts,), float(mv.gate_scale)))


def _flatten_tokens(hidden: torch.Tensor):
    """[S, B, D] -> ([S*B, D], S, B); [T, D] -> ([T, D], T, 1)."""
    if hidden.dim() == 3:
        seq_length, batch_size, _ = hidden.shape
        return hidden.reshape(seq_length * batch_size, -1), seq_length, batch_size
    if hidden.dim() == 2:
        return hidden, hidden.shape[0], 1
    raise ValueError(f"hidden: expected [S, B, D] or [T, D], got shape {tuple(hidden.shape)}")


def _sum_or_none(*values):
    present = [v for v in values if v is not None]
    return sum(present) if present else None
