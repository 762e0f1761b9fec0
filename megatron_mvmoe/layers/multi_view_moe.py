"""Multi-View MoE (seed 000, Eq. 4-5, Algorithm 1) as a Megatron MoELayer: `MultiViewMoELayer`.

Legend: T tokens (flattened [S, B] order), D hidden size, L latent size, E experts,
R routing heads (= K views), S selected slots per token (top-k).

Phases (LatentMoELayer's, two of them overridden):
- route: `MultiRouter.route` -> probs_TE, routing_map_TE and the mixing weights mix_TSR
  (a_{m,i} = s_{m,i} / sum_n s_{n,i}); the mix is kept until preprocess (the next phase of
  the same forward), as Megatron's dispatchers keep their routing metadata between phases.
- preprocess: views_TRL = [P h, P h + gamma dP_m h]; rows_TSL = mix_views(views, mix): the
  blend is formed BEFORE dispatch, one latent row per (token, selected expert), then
  `PerRowAlltoAllTokenDispatcher` gathers those rows in Megatron's expert-major order.
  The expert computes E_i(sum_m a_{m,i} v_m), never sum_m a_{m,i} E_i(v_m), and the bytes
  through the all-to-all equal the latent baseline's (T*S rows of L either way).
  With the Triton backend (`multi_view.kernels`, see below) the blend and the permute are
  one kernel, `mvmoe_kernels.mix_and_permute`: each blend is written once, straight into
  its dispatch row in Megatron's order (`expert_major_rows`), and rows_TSL never exists.

Design choices:
- Only the alltoall dispatcher: the allgather and flex dispatchers send unique tokens and
  permute on arrival, so per-expert rows there would cost up to k times more; the config
  refuses them (MVMoETransformerConfig._validate_multi_view) naming moe_token_dispatcher_type.
- gamma comes from a `GammaRamp` owned by the layer; its state is the persistent buffer
  `gamma_ramp_state` = [ramp_steps, step] (int64), so checkpoints carry it and a resume
  continues the ramp (from another ramp length: at the saved step, with this run's length;
  the trainer's resume line names the change). The
  training loop advances it once per optimizer step (training/gamma_ramp.py; callers find
  the layer by its `views.protocols.GammaRamped` / `ViewMixing` methods, not by this class).
- Kernel choice: `multi_view.kernels` "auto" defers to MVMOE_KERNELS (default: Triton on
  CUDA, the torch path elsewhere); "triton" / "reference" force one. Both paths compute
  v_0 + sum_{m>0} a_m (v_m - v_0) (the kernel as mix weights [1, a_1, ..] over views
  [v_0, v_1 - v_0, ..]), so at gamma = 0 every row is P h bit for bit on either path.
- Capacity and token dropping (`moe_expert_capacity_factor`): the router drops (token,
  expert) rows with Megatron's rule on the gates (routing/router.py). Rule for the views: a
  dropped pair's blend is never computed (rows are built only for the pairs left in the
  routing map, `capacity_rows`); its gate is 0, so it contributes nothing, as a dropped token
  does in Megatron. A pair that capacity PADDING adds (the token did not select that expert)
  gets the backbone view P h, i.e. mix weights one-hot on view 0 (its gate is 0, and P h is
  exactly the latent baseline's padded row, so at gamma = 0 the layer still equals the
  baseline). Eq. 4's a_{m,i} is only defined over the selection's normaliser, so no other
  blend is more natural for it. This path always runs on torch (the fused kernel writes the
  dropless order); the bytes are the latent baseline's: one row per pair in the final map.
- Process groups arrive like Megatron's own MoELayer's: TransformerLayer calls the MLP
  builder with `pg_collection=` (Megatron's defaults only when built standalone).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import mvmoe_kernels
import torch
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_mvmoe.errors import require
from megatron_mvmoe.layers.latent_moe import LatentMoELayer
from megatron_mvmoe.layers.per_row_dispatcher import PerRowAlltoAllTokenDispatcher
from megatron_mvmoe.functional.mixing import blend_views
from megatron_mvmoe.functional.permute import map_rows
from megatron_mvmoe.functional.routing import slots_of_experts
from megatron_mvmoe.views import GammaRamp, MultiViewProjection


class MultiViewMoELayer(LatentMoELayer):
    """Latent MoE whose experts see router-conditioned blends of K latent views."""

    def __init__(self, config, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None) -> None:
        assert config.moe_token_dispatcher_type == "alltoall", "validated by the config"
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        require(hasattr(self.router, "route"), "MoESubmodules.router",
                f"{type(self.router).__name__} gives no per-head scores to mix views with",
                "use megatron_mvmoe.routing.router.MultiRouter")
        self.token_dispatcher = PerRowAlltoAllTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection)
        self.stop_grad_mixing = config.multi_view.stop_grad_mixing
        self.gamma_ramp = GammaRamp(config.multi_view.gamma_ramp_steps)
        self.register_buffer("gamma_ramp_state", torch.tensor(
            [self.gamma_ramp.ramp_steps, 0], dtype=torch.int64))
        self.kernel_backend = mvmoe_kernels.backend_at_build(config.multi_view.kernels)
        """"triton" or "reference" for every forward (multi_view.kernels, else MVMOE_KERNELS,
        on this process's device), resolved once here."""
        self._pending = None  # (mix_TSR, topk_idx_TS) from route, taken by preprocess
        self.mix_transforms: List[Callable[[torch.Tensor], torch.Tensor]] = []
        """Applied in order to the mixing weights mix_TSR before the blend, on every backend
        (analysis.routing.interventions swaps the mixing proportions this way); empty in training."""

    def build_down_projection(self, config) -> torch.nn.Module:
        """K views: view 0 is the backbone P (`fc1_latent_proj.weight`), others P + gamma dP_m."""
        return MultiViewProjection(config)

    def views_of(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """views_TRL of the tokens at the current gamma (what preprocess blends)."""
        return self.fc1_latent_proj(hidden_TD, self.gamma())

    # ---- gamma ramp -------------------------------------------------------------------
    def gamma(self) -> float:
        return self.gamma_ramp.value()

    def advance_gamma(self, num_steps: int = 1) -> float:
        """Count optimizer steps; returns the new gamma."""
        value = self.gamma_ramp.advance(num_steps)
        self.gamma_ramp_state[1] = self.gamma_ramp.step
        return value

    def restart_gamma(self) -> None:
        """Back to step 0 (gamma = 0 when ramping): used by the warm start."""
        self.gamma_ramp.step = 0
        self.gamma_ramp_state[1] = 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        ramp_steps, step = (int(v) for v in self.gamma_ramp_state.tolist())
        self.gamma_ramp.load_state_dict({"ramp_steps": ramp_steps, "step": step})
        self.gamma_ramp_state[0] = self.gamma_ramp.ramp_steps  # this run's length applies

    # ---- named phases -----------------------------------------------------------------
    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """MultiRouter routing; keeps the mixing weights and slots for preprocess."""
        routing = self.router.route(hidden_states, padding_mask)
        self._pending = (routing.mix_TSR, routing.topk_idx_TS)
        return routing.probs_TE, routing.routing_map_TE

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor):
        """Views -> per-(token, slot) blends -> per-row permute (same metadata as baseline)."""
        (mix_TSR, topk_idx_TS), self._pending = self._pending, None
        for transform in self.mix_transforms if mix_TSR is not None else ():
            mix_TSR = transform(mix_TSR)
        if mix_TSR is not None and self.stop_grad_mixing:
            mix_TSR = mix_TSR.detach()
        hidden_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        views_TRL = self.fc1_latent_proj(hidden_TD, self.gamma())
        token_shape = (*hidden_states.shape[:-1], self.latent_size)
        return self.token_dispatcher.dispatch_preprocess_views(
            self, views_TRL, mix_TSR, topk_idx_TS, routing_map, probs, token_shape)

    def dispatch_rows(self, views_TRL, mix_TSR, topk_idx_TS, routing_map, probs, token_shape):
        """What a rows dispatcher asks of the layer (`PerRowDispatch`, "rows"): one blended
        row per (token, expert), built by the capacity path, the fused kernel or the torch
        blend, handed to its row entries."""
        if self.config.moe_expert_capacity_factor is not None:
            rows_NL, row_token_N = self.capacity_rows(views_TRL, mix_TSR, topk_idx_TS,
                                                      routing_map)
        elif self.kernel_backend == "triton":
            rows_NL, row_token_N = self.permuted_expert_rows(views_TRL, mix_TSR, topk_idx_TS)
        else:
            rows_TSL = self.expert_rows(views_TRL, mix_TSR)
            return self.token_dispatcher.dispatch_preprocess_rows(
                rows_TSL, routing_map, probs, token_shape)
        return self.token_dispatcher.dispatch_preprocess_permuted(
            rows_NL, row_token_N, routing_map, probs, token_shape)

    def expert_rows(self, views_TRL: torch.Tensor, mix_TSR: Optional[torch.Tensor]):
        """rows_TSL: what the expert of slot s sees for token t (Eq. 5's inner sum).

        Computed as v_0 + sum_m a_m (v_m - v_0), which equals sum_m a_m v_m because the
        weights sum to 1. At gamma = 0 the differences are exactly zero, so the rows are
        P h bit for bit (the warm start reproduces the baseline exactly) while every
        parameter stays in the autograd graph (Megatron's overlapped grad reduce needs it).
        """
        num_tokens, _, latent = views_TRL.shape
        if mix_TSR is None:  # one view: every slot sees the backbone view, as the baseline
            return views_TRL[:, :1, :].expand(num_tokens, self.config.moe_router_topk, latent)
        return blend_views(views_TRL, mix_TSR)

    def capacity_rows(self, views_TRL: torch.Tensor, mix_TSR: Optional[torch.Tensor],
                      topk_idx_TS: torch.Tensor, routing_map_TE: torch.Tensor):
        """(rows_NL, row_token_N) for the pairs the capacity left in routing_map_TE, in
        Megatron's permute order: a kept slot's blend (only kept pairs are blended), a padded
        pair's backbone view P h (mix one-hot on view 0). See the module docstring."""
        order = map_rows(routing_map_TE, slots_of_experts(topk_idx_TS,
                                                          self.config.num_moe_experts))
        views_NRL = views_TRL.index_select(0, order.row_token_N)
        if mix_TSR is None:  # one view: every row is the backbone view, as the baseline's
            return views_NRL[:, 0], order.row_token_N
        backbone_T1R = torch.zeros_like(mix_TSR[:, :1])
        backbone_T1R[..., 0] = 1
        mix_NR = torch.cat([mix_TSR, backbone_T1R], dim=1)[order.row_token_N,
                                                            order.row_slot_N]
        return blend_views(views_NRL, mix_NR.unsqueeze(1))[:, 0], order.row_token_N

    def permuted_expert_rows(self, views_TRL: torch.Tensor, mix_TSR: Optional[torch.Tensor],
                             topk_idx_TS: torch.Tensor):
        """(rows_NL, row_token_N): `expert_rows` written straight into Megatron's permute
        order by the fused kernel. The same v_0 + sum_m a_m (v_m - v_0) as weights
        [1, a_1, ..] over views [v_0, v_1 - v_0, ..]: the m = 0 difference is zero, so its
        weight is free and set to 1 (exact at gamma = 0, same gradients)."""
        order = mvmoe_kernels.expert_major_rows(topk_idx_TS, self.config.num_moe_experts)
        offsets_TRL, weights_TSR = _backbone_offsets(views_TRL, mix_TSR, topk_idx_TS.shape[1])
        rows_NL = mvmoe_kernels.mix_and_permute(offsets_TRL, weights_TSR, order.row_token_N,
                                                order.row_slot_N, backend="triton")
        return rows_NL, order.row_token_N


def _backbone_offsets(views_TRL: torch.Tensor, mix_TSR: Optional[torch.Tensor],
                      num_slots: int):
    """Views [v_0, v_1 - v_0, ..] and weights [1, a_1, ..] (one view: [v_0] and [1])."""
    backbone_T1L = views_TRL[:, :1, :]
    ones_TS1 = views_TRL.new_ones(views_TRL.shape[0], num_slots, 1, dtype=torch.float32)
    if mix_TSR is None:
        return backbone_T1L, ones_TS1
    offsets_TRL = torch.cat([backbone_T1L, views_TRL[:, 1:] - backbone_T1L], dim=1)
    return offsets_TRL, torch.cat([ones_TS1, mix_TSR[..., 1:].float()], dim=-1)

