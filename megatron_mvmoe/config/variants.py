"""The model variants, once: what each one is made of, so code asks a variant's properties
instead of comparing `moe_variant` strings. Pure Python (no Megatron, no torch).

| variant | routed experts | latent (D -> L) | router | per-(token, expert) rows | sub-tokens |
|---|---|---|---|---|---|
| dense | no | | | | |
| smoe | yes | no | Megatron TopKRouter, softmax + aux loss | no | no |
| latent | yes | yes | Megatron TopKRouter, sigmoid + expert bias | no | no |
| multi_router | yes | yes | MultiRouter (R heads) | no | no |
| multi_view | yes | yes | MultiRouter (R heads) | yes (K views mixed) | no |
| mh_moe | yes | no | Megatron TopKRouter, softmax + aux loss | no | yes (H per token) |

models/specs.py maps these properties to layer classes; models/provider.py to routing
defaults; analysis/plan.py and analysis/a2a/analytic.py to costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from megatron_mvmoe.errors import require


@dataclass(frozen=True)
class Variant:
    name: str
    routed_experts: bool
    """Has MoE layers (False only for the dense baseline)."""
    latent: bool = False
    """Routed experts run on latent rows z = P h (seed 000's latent MoE)."""
    multi_router: bool = False
    """R sigmoid routing heads summed after the sigmoid (MultiRouter)."""
    multi_view: bool = False
    """Each selected expert gets its own blended row of K views (per-row dispatch)."""
    multi_head: bool = False
    """Tokens split into H sub-tokens routed on their own (MH-MoE)."""

    @property
    def sigmoid_routing(self) -> bool:
        """Sigmoid scores with the aux-loss-free expert bias (seed 000's routing) rather
        than softmax top-k with an aux loss (the classic SMoE, seed 001)."""
        return self.latent


VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("dense", routed_experts=False),
    Variant("smoe", routed_experts=True),
    Variant("latent", routed_experts=True, latent=True),
    Variant("multi_router", routed_experts=True, latent=True, multi_router=True),
    Variant("multi_view", routed_experts=True, latent=True, multi_router=True,
            multi_view=True),
    Variant("mh_moe", routed_experts=True, multi_head=True),
)}
VARIANT_NAMES: Tuple[str, ...] = tuple(VARIANTS)


def get_variant(name: str) -> Variant:
    """The variant called `name`; a ValueError naming `moe_variant` otherwise."""
    require(name in VARIANTS, "moe_variant", f"unknown variant {name!r}",
            f"use one of {VARIANT_NAMES}")
    return VARIANTS[name]
