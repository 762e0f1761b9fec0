"""Latent views (seed 000, Sec. "Initialization"): v_1 = P h, v_m = P h + gamma dP_m h.

Legend: T tokens (any leading dims), D hidden size, L latent size, R views (= K = routing heads).

Design choices:
- `weight` [L, D] is the backbone latent down-projection P, in nn.Linear / Megatron linear
  layout and name, so with K = 1 this module's state dict is exactly a baseline latent
  down-projection's ({"weight"}) and a baseline checkpoint warm-starts the backbone view;
  `view_perturbations` [K-1, L, D] hold dP_2..dP_K (absent from baseline checkpoints).
- dP_m is initialised N(0, multi_view.view_init_std) and scaled by gamma, which the caller
  ramps 0 -> 1 (views.schedule.GammaRamp); at gamma = 0 every view is exactly P h.
- Two GEMMs: P h once, all perturbations in one [(K-1)*L, D] GEMM.
- BitNet (`config.bitnet.enabled`): view m is Q(P + gamma dP_m) h with one ternary matrix per
  view and int-quantized h, so every view is a BitNet linear (one [K*L, D] GEMM).
- The weights are replicated on every TP rank. Under sequence parallelism each rank sees a
  different slice of tokens, so the parameters carry `sequence_parallel = True` and Megatron's
  finalize_model_grads all-reduces their gradients over TP (untagged, replicas drift apart).
"""

from __future__ import annotations

import torch

from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.functional.quantize import bitlinear_input, quantize_weight_ste


class MultiViewProjection(torch.nn.Module):
    """h [..., D] -> views [..., K, L]; view 0 is the backbone P h."""

    def __init__(self, config: MVMoETransformerConfig) -> None:
        super().__init__()
        if config.latent_size is None or config.latent_size <= 0:
            raise ValueError(
                f"latent_size: MultiViewProjection needs a positive latent size, got "
                f"{config.latent_size}. Fix: set latent_size (e.g. hidden_size // 2)")
        self.num_views = config.multi_view.num_views
        self.latent_size = config.latent_size
        self.hidden_size = config.hidden_size
        shape_LD = (config.latent_size, config.hidden_size)
        self.weight = torch.nn.Parameter(torch.empty(shape_LD, dtype=torch.float32))
        self.view_perturbations = torch.nn.Parameter(
            torch.empty((self.num_views - 1, *shape_LD), dtype=torch.float32))
        self._reset_parameters(config)
        bitnet = config.bitnet
        self.bitnet_bits = bitnet.activation_bits if bitnet.enabled else None
        """Activation bits of the BitNet views, None when full precision."""
        self.bitnet_input_norm = bitnet.enabled and bitnet.input_norm

    def _reset_parameters(self, config: MVMoETransformerConfig) -> None:
        if config.perform_initialization:
            config.init_method(self.weight)
            torch.nn.init.normal_(self.view_perturbations, 0.0, config.multi_view.view_init_std)
        for param in (self.weight, self.view_perturbations):
            param.data = param.data.to(config.params_dtype)
            # replicated over TP: with SP the grads must be all-reduced across TP ranks
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def forward(self, hidden_TD: torch.Tensor, gamma: float) -> torch.Tensor:
        """views_TRL [..., K, L]: views[..., 0, :] = P h, views[..., m, :] = P h + gamma dP_m h."""
        if self.bitnet_bits is not None:
            return self._bitnet_views(hidden_TD, gamma)
        backbone_TL = torch.nn.functional.linear(hidden_TD, self.weight)
        if self.num_views == 1:
            return backbone_TL.unsqueeze(-2)
        perturb_X_D = self.view_perturbations.reshape(-1, self.hidden_size)  # X = (K-1)*L
        perturb_TX = torch.nn.functional.linear(hidden_TD, perturb_X_D)
        perturb_TML = perturb_TX.unflatten(-1, (self.num_views - 1, self.latent_size))
        backbone_T1L = backbone_TL.unsqueeze(-2)
        return torch.cat([backbone_T1L, backbone_T1L + gamma * perturb_TML], dim=-2)

    def _bitnet_views(self, hidden_TD: torch.Tensor, gamma: float) -> torch.Tensor:
        """BitNet b1.58: view m applies ONE ternary matrix, Q(P + gamma dP_m) (absmean scale,
        STE), to the RMS-normalised, int-quantized token, so every view is a BitNet linear; at gamma = 0
        each Q(P + 0) is Q(P) exactly and every view equals the backbone view."""
        hidden_TD = bitlinear_input(hidden_TD, self.bitnet_bits, self.bitnet_input_norm)
        weight_KLD = torch.cat([self.weight.unsqueeze(0),
                                self.weight.unsqueeze(0) + gamma * self.view_perturbations])
        quantized_KLD = torch.stack([quantize_weight_ste(w_LD) for w_LD in weight_KLD])
        quantized_XD = quantized_KLD.reshape(-1, self.hidden_size)  # X = K*L
        views_TX = torch.nn.functional.linear(hidden_TD, quantized_XD)
        return views_TX.unflatten(-1, (self.num_views, self.latent_size))
