"""mvmoe_kernels: Triton kernels for Multi-View MoE (seed 000), each with a torch reference.

The repository's mvmoe_kernels/ package (named so it cannot clash
with the PyPI package called `kernels`). Triton is optional:
importing this package never imports triton; the kernels are decorated at first use.

Public API (legend: T tokens, E experts, R routing heads = K views, S slots, L latent,
N dispatched rows):
- fused_multi_router(logits_TRE, bias_E, k, alpha, eps, backend=None) -> RouterOutput(
      topk_idx_TS, gates_TS, mix_TSR, summed_TE)
- expert_major_rows(topk_idx_TS, E) -> DispatchRows(row_token_N, row_slot_N,
      tokens_per_expert_E)   (Megatron's permute order)
- mix_and_permute(views_TRL, mix_TSR, row_token_N, row_slot_N, backend=None) -> rows_NL
- reference_multi_router / reference_mix_and_permute: the pure-torch specifications
- backend selection: argument `backend=`, else env MVMOE_KERNELS=triton|reference|auto
"""

from .backend import BACKENDS, ENV_VAR, backend_at_build, resolve_backend
from .fused_routing import fused_multi_router
from .mix_permute import mix_and_permute
from .reference import (
    DispatchRows,
    RouterOutput,
    expert_major_rows,
    reference_mix_and_permute,
    reference_multi_router,
)

__all__ = [
    "BACKENDS", "DispatchRows", "ENV_VAR", "RouterOutput", "backend_at_build", "expert_major_rows",
    "fused_multi_router", "mix_and_permute", "reference_mix_and_permute",
    "reference_multi_router", "resolve_backend",
]
