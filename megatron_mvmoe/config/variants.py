"""The model variants, once: what each one is made of, how it is built and what it costs, so
code asks a variant's record instead of comparing `moe_variant` strings. Pure Python (no
Megatron, no torch).

| variant | routed experts | latent (D -> L) | router | per-(token, expert) rows | sub-tokens |
|---|---|---|---|---|---|
| dense | no | | | | |
| smoe | yes | no | Megatron TopKRouter, softmax + aux loss | no | no |
| latent | yes | yes | Megatron TopKRouter, sigmoid + expert bias | no | no |
| multi_router | yes | yes | MultiRouter (R heads) | no | no |
| multi_view | yes | yes | MultiRouter (R heads) | yes (K views mixed) | no |
| mh_moe | yes | no | Megatron TopKRouter, softmax + aux loss | no | yes (H per token) |

Legend: D hidden, L latent, E experts, F expert width, k top-k, R routing heads, K views,
H MH-MoE sub-tokens, S shared-expert width.

Design choices:
- A record carries what callers ask instead of comparing names (torchtitan's TrainSpec: the
  registered object carries its callables): its MoE slot builder `moe_layer` (a callable;
  the shipped ones are `BuilderRef`s, imported on first call so this module stays pure
  Python), whether it mixes views (`multi_view`, `views_per_token`) and has a gamma ramp,
  the dispatchers that can carry it (`dispatchers`; config/dispatchers.py derives its lists
  from them), the remote-code MoE structure an HF export writes (`hf_structure`, None:
  refused) and `routing_defaults` (models/provider.py). A new variant is one record,
  `register_variant(...)`, plus its layer (docs/architecture.md, "Adding a variant";
  tests/models/test_throwaway_variant.py registers one from a temporary module).
- Costs per MoE layer and token come from `MoEDims` (a ModelSection's sizes): parameters
  (functional.parity's `LayerParams`: SMoE and MH-MoE ARE the parity shapes, the latent
  family adds its projections, views and R router heads), the planner's matmul FLOPs
  (2 x active parameters, router included), the paper's leading count (router excluded,
  as seed 001's Eq. 6-7) and the alltoall bytes. Whole models: config/model_costs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from importlib import import_module
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from megatron_mvmoe.errors import require
from megatron_mvmoe.functional.parity import LayerParams, MoELayerShape, layer_params

SWIGLU_MATRICES = 3
"""A SwiGLU expert (and shared expert): fc1 [2F, d_in] + fc2 [d_in, F]."""

GELU_MATRICES = 2
"""A GeLU expert (Megatron-LM without --swiglu): fc1 [F, d_in] + fc2 [d_in, F]."""

ALL_DISPATCHERS = ("alltoall", "dedup_rank", "dedup_node")
"""`Variant.dispatchers` of a routed variant every dispatcher carries (config/dispatchers.py
holds the dispatcher records under these names)."""

HF_STRUCTURES = ("dense", "smoe", "latent", "multi_router", "multi_view", "mh_moe")
"""`Variant.hf_structure`: the MLPs hf/remote/moe_layers.py builds (its `MOE_STRUCTURES`
rows, written as the exported config's `moe_variant`)."""


@dataclass(frozen=True)
class BuilderRef:
    """A builder named by module and attribute, imported on first call (config/ imports
    no torch or Megatron; the builders do)."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(import_module(self.module), self.name)(*args, **kwargs)


def _spec_builder(name: str) -> BuilderRef:
    return BuilderRef("megatron_mvmoe.models.specs", name)

SIGMOID_ROUTING: Mapping[str, Any] = MappingProxyType(dict(
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    moe_router_bias_update_rate=1e-3))
"""Seed 000's routing: sigmoid scores, the aux-loss-free expert bias."""

SOFTMAX_ROUTING: Mapping[str, Any] = MappingProxyType(dict(
    moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=1e-2))
"""The classic SMoE (seed 001): softmax top-k with a small aux loss."""


@dataclass(frozen=True)
class MoEDims:
    """The sizes of one MoE layer that its costs depend on (`MoEDims.of(model_section)`)."""

    hidden: int
    """D."""
    experts: int
    """E."""
    expert_ffn: int
    """F: intermediate size of one routed expert."""
    topk: int
    """k: experts per routed row (per sub-token for MH-MoE)."""
    shared_ffn: int = 0
    """S: shared-expert width; 0 = none."""
    latent: Optional[int] = None
    """L: latent size (the latent family)."""
    routers: int = 1
    """R: routing heads (Multi-Router, Multi-View)."""
    views: int = 1
    """K: views (Multi-View)."""
    heads: int = 1
    """H: MH-MoE sub-tokens per token."""
    head_projection: bool = True
    """MH-MoE's D x D projection before the split."""
    merge_projection: bool = True
    """MH-MoE's D x D projection after the concatenation."""
    expert_matrices: int = SWIGLU_MATRICES
    """SWIGLU_MATRICES (a gated MLP: model.gated_mlp) or GELU_MATRICES."""
    biases: bool = False
    """model.add_bias_linear: every expert's fc1 / fc2 and the router have a bias (only
    the stock layer: validate_mvmoe refuses biases with the others' projections)."""

    @classmethod
    def of(cls, section) -> "MoEDims":
        """The MoE layer of a ModelSection (read by field name: config/ imports nothing)."""
        mv, mh = section.multi_view, section.multi_head
        return cls(hidden=section.hidden_size, experts=section.num_experts,
                   expert_ffn=section.moe_ffn_hidden_size, topk=section.moe_router_topk,
                   shared_ffn=section.moe_shared_expert_intermediate_size or 0,
                   latent=section.latent_size, routers=mv.num_routers, views=mv.num_views,
                   heads=mh.num_heads, head_projection=mh.head_projection,
                   merge_projection=mh.merge_projection,
                   expert_matrices=SWIGLU_MATRICES if section.gated_mlp else GELU_MATRICES,
                   biases=section.add_bias_linear)


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
    moe_layer: Optional[Callable[..., Any]] = None
    """`(config, moe_spec, variant) -> the MoE slot's builder` (models/specs.py calls it with
    Megatron's MoE builder for the slot); None: Megatron's own MoELayer, the slot as is."""
    dispatchers: Tuple[str, ...] = ALL_DISPATCHERS
    """The token dispatchers (config/dispatchers.py names) that can carry its rows."""
    hf_structure: Optional[str] = None
    """The remote-code MoE structure that computes it (one of HF_STRUCTURES, the exported
    `moe_variant`); None: the HF export refuses the variant."""
    routing_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Megatron routing fields models/provider.py sets for the variant (a run's `extra`
    overrides them)."""

    def __post_init__(self) -> None:
        require(self.hf_structure is None or self.hf_structure in HF_STRUCTURES,
                "Variant.hf_structure", f"unknown {self.hf_structure!r}",
                f"use one of {HF_STRUCTURES}, or None to refuse the export")
        require(self.routed_experts or not self.dispatchers, "Variant.dispatchers",
                f"{self.name!r} has no routed experts to dispatch", "leave it ()")

    @property
    def has_gamma_ramp(self) -> bool:
        """Its layers own a gamma ramp the trainer advances once per optimizer step (the
        layers implement views.protocols.GammaRamped)."""
        return self.multi_view

    def views_per_token(self, config) -> int:
        """K: the views the dispatcher carries per token (config.multi_view.num_views for a
        variant that mixes views, else 1)."""
        return config.multi_view.num_views if self.multi_view else 1

    @property
    def sigmoid_routing(self) -> bool:
        """Sigmoid scores with the aux-loss-free expert bias (seed 000's routing) rather
        than softmax top-k with an aux loss (the classic SMoE, seed 001)."""
        return self.latent

    @property
    def family(self) -> str:
        """The baseline this variant is measured against: "latent", "smoe" or "dense"."""
        return "latent" if self.latent else ("smoe" if self.routed_experts else "dense")

    def head_counts(self, heads: int) -> Dict[str, int]:
        """num_routers / num_views / num_heads of this variant with `heads` routing heads,
        views or sub-tokens (1 where the variant has none)."""
        routers = heads if self.multi_router else 1
        return {"num_routers": routers, "num_views": routers if self.multi_view else 1,
                "num_heads": heads if self.multi_head else 1}

    # ------------------------------------------------------------------- per-layer costs
    def routed_rows(self, heads: int) -> int:
        """Rows one token routes: its H sub-tokens (MH-MoE), else 1."""
        return heads if self.multi_head else 1

    def expert_input(self, hidden: int, latent: Optional[int], heads: int) -> int:
        """Width of a routed row (what an expert sees and the all-to-all sends)."""
        self._require_routed()
        if self.multi_head:
            require(hidden % heads == 0, "heads", f"{heads} does not divide hidden {hidden}",
                    "choose a head count that divides hidden_size")
            return hidden // heads
        if self.latent:
            require(bool(latent) and latent > 0, "latent",
                    f"variant {self.name} needs a positive latent size", "set latent_size")
            return latent
        return hidden

    def layer_params(self, d: MoEDims) -> LayerParams:
        """Parameters of one MoE layer, by component."""
        if not self.latent:
            return _with_biases(layer_params(self._parity_shape(d)), d)
        L = self.expert_input(d.hidden, d.latent, d.heads)
        expert = d.expert_matrices * L * d.expert_ffn
        views = (d.views - 1) * L * d.hidden if self.multi_view else 0
        routers = d.routers if self.multi_router else 1
        return LayerParams(projections=2 * L * d.hidden + views, expert=expert,
                           experts_total=d.experts * expert, experts_active=d.topk * expert,
                           router=routers * d.experts * d.hidden,
                           shared=d.expert_matrices * d.hidden * d.shared_ffn)

    def matmul_flops_per_token(self, d: MoEDims) -> int:
        """The planner's forward count: 2 x the active parameters (routers included)."""
        return 2 * self.layer_params(d).active

    def leading_flops_per_token(self, d: MoEDims) -> int:
        """The paper's leading term (seed 001, Eq. 6-7): as above without the gating."""
        params = self.layer_params(d)
        return 2 * (params.active - params.router)

    def mixing_flops_per_token(self, d: MoEDims) -> int:
        """Multi-View's blend of K views into each of the k rows (a multiply-add per
        element and view); 0 for the others."""
        return 2 * d.topk * d.views * d.latent if self.multi_view else 0

    def a2a_bytes_per_token(self, d: MoEDims, dtype_bytes: int = 2) -> int:
        """Token bytes one token puts into the alltoall dispatch (one direction): H k rows
        of the row width (Multi-View mixes first: one row per (token, expert), like the
        baseline)."""
        width = self.expert_input(d.hidden, d.latent, d.heads)
        return self.routed_rows(d.heads) * d.topk * width * dtype_bytes

    def _parity_shape(self, d: MoEDims) -> MoELayerShape:
        self._require_routed()
        mh = self.multi_head
        return MoELayerShape(hidden_size=d.hidden, num_experts=d.experts,
                             expert_ffn=d.expert_ffn, topk=d.topk,
                             num_heads=d.heads if mh else 1,
                             head_projection=mh and d.head_projection,
                             merge_projection=mh and d.merge_projection,
                             shared_expert_ffn=d.shared_ffn, expert_matrices=d.expert_matrices)

    def _require_routed(self) -> None:
        require(self.routed_experts, "moe_variant",
                f"{self.name!r} has no MoE layer to count", "ask a routed variant")


def _with_biases(params: LayerParams, d: MoEDims) -> LayerParams:
    """Megatron's stock MoE layer with add_bias_linear: each expert's fc1 bias (its rows)
    and fc2 bias (D), and the router's bias of E."""
    if not d.biases:
        return params
    expert = params.expert + (d.expert_matrices - 1) * d.expert_ffn + d.hidden
    return replace(params, expert=expert, experts_total=d.experts * expert,
                   experts_active=d.topk * expert, router=params.router + d.experts)


VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("dense", routed_experts=False, dispatchers=(), hf_structure="dense"),
    Variant("smoe", routed_experts=True, hf_structure="smoe",
            routing_defaults=SOFTMAX_ROUTING),
    Variant("latent", routed_experts=True, latent=True,
            moe_layer=_spec_builder("latent_layer"), hf_structure="latent",
            routing_defaults=SIGMOID_ROUTING),
    Variant("multi_router", routed_experts=True, latent=True, multi_router=True,
            moe_layer=_spec_builder("multi_router_layer"), hf_structure="multi_router",
            routing_defaults=SIGMOID_ROUTING),
    Variant("multi_view", routed_experts=True, latent=True, multi_router=True,
            multi_view=True, moe_layer=_spec_builder("multi_view_layer"),
            hf_structure="multi_view", routing_defaults=SIGMOID_ROUTING),
    Variant("mh_moe", routed_experts=True, multi_head=True,
            moe_layer=_spec_builder("multi_head_layer"), dispatchers=("alltoall",),
            hf_structure="mh_moe", routing_defaults=SOFTMAX_ROUTING),  # dedup: no sub-tokens
)}
"""The registry: every lookup reads it live, so a variant registered later is known to
the config, the dispatchers, the block spec and the export alike."""
VARIANT_NAMES: Tuple[str, ...] = tuple(VARIANTS)
"""The shipped variants (docs, tables); `variant_names()` includes registered ones."""
ROUTED_VARIANT_NAMES: Tuple[str, ...] = tuple(n for n, v in VARIANTS.items()
                                              if v.routed_experts)


def variant_names() -> Tuple[str, ...]:
    """Every variant known now, registered ones included."""
    return tuple(VARIANTS)


def register_variant(variant: Variant) -> Variant:
    """Add `variant` to the registry (a new name only); returns it."""
    require(variant.name not in VARIANTS, "Variant.name", f"{variant.name!r} is taken",
            "register the variant under a new name")
    VARIANTS[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    """The variant called `name`; a ValueError naming `moe_variant` otherwise."""
    require(name in VARIANTS, "moe_variant", f"unknown variant {name!r}",
            f"use one of {variant_names()}")
    return VARIANTS[name]
