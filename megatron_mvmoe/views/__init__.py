"""Multi-View latent views (seed 000, Eq. 4-5): projections and the gamma ramp; the mixing
math lives in megatron_mvmoe.functional.mixing (re-exported here).

Public API (legend: T tokens, D hidden, L latent, R routing heads = K views, S slots):
- MultiViewProjection(config)(hidden_TD, gamma) -> views_TRL
- GammaRamp(ramp_steps): value(step), advance(), state_dict(), load_state_dict()
- mixing_weights(scores_TRE, topk_idx_TS) -> mix_TSR
- mix_views(views_TRL, mix_TSR, stop_grad_mixing) -> rows_TSL
"""

from megatron_mvmoe.functional.mixing import mix_views, mixing_weights
from megatron_mvmoe.views.projections import MultiViewProjection
from megatron_mvmoe.views.schedule import GammaRamp

__all__ = ["GammaRamp", "MultiViewProjection", "mix_views", "mixing_weights"]
