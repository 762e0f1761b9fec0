"""The token dispatchers a model can be built with, once: what each one supports and refuses,
so the config refuses an unsupported (dispatcher, variant or feature) pair at load with one
error naming both and the alternative. Pure Python (no Megatron, no torch); the builders
are layers/dispatchers.py's, keyed by the same names.

| dispatcher | what crosses the wire | variants | refuses |
|---|---|---|---|
| alltoall | Megatron's alltoall rows (Multi-View: one blended row per (token, expert)) | every MoE variant | with views mixed: padding for quantization, fused permute, shared-expert overlap |
| dedup_rank | one copy per (token, destination rank), DeepEP-style | smoe, latent, multi_router, multi_view | capacity, ETP > 1, padding for quantization, fused permute, shared-expert overlap |
| dedup_node | one copy per (token, destination node), forwarded inside the node, HybridEP-style | as dedup_rank | as dedup_rank, and a node size that does not divide EP |

Design choices:
- The variants a dispatcher carries are not listed here: each variant record names its
  dispatchers (`Variant.dispatchers`, config/variants.py) and `Dispatcher.variants` reads
  the registry, so a registered variant is carried without an edit here.
- The refusals are written here only (MegaBlocks' dmlp_registry: one list naming the
  unsupported pairs): the config checks them at load (`check_dispatcher`), and the
  dispatchers' constructors call `check_refusals` with their record, so a dispatcher built
  outside a run config refuses the same pairs with the same line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from megatron_mvmoe.config.variants import VARIANTS, get_variant
from megatron_mvmoe.errors import require


@dataclass(frozen=True)
class Refusal:
    """A config feature a dispatcher cannot run with."""

    field: str
    """The Megatron config field (the error names it as the run config writes it)."""
    refused: Callable[[Any], bool]
    """True when the config sets the feature."""
    why: str
    only_mixing_views: bool = False
    """Refused only for a variant that mixes views (per-(token, expert) rows)."""


@dataclass(frozen=True)
class Dispatcher:
    name: str
    semantics: Optional[str]
    """The dedup dispatcher's semantics ("rank" / "node"), None for the alltoall rows."""
    refuses: Tuple[Refusal, ...] = ()

    @property
    def variants(self) -> Tuple[str, ...]:
        """The moe_variant values it can dispatch for (the records that name it)."""
        return tuple(v.name for v in VARIANTS.values() if self.name in v.dispatchers)


_ROW_REFUSES = (
    Refusal("moe_router_padding_for_quantization",
            lambda c: bool(c.moe_router_padding_for_quantization),
            "padding the routing map would shift the slot order of the rows"),
    Refusal("moe_permute_fusion", lambda c: bool(c.moe_permute_fusion),
            "the fused (TE) permute gathers replicated tokens, not per-(token, expert) rows"),
    Refusal("moe_shared_expert_overlap", lambda c: bool(c.moe_shared_expert_overlap),
            "the overlap hooks see the dispatcher's rows"),
)
"""What per-(token, expert) rows cannot run with: Multi-View's alltoall and the dedup
dispatchers."""
_ROWS_WITH_VIEWS = tuple(Refusal(r.field, r.refused, r.why, only_mixing_views=True)
                         for r in _ROW_REFUSES)
_DEDUP_REFUSES = (
    Refusal("moe_expert_capacity_factor", lambda c: c.moe_expert_capacity_factor is not None,
            "it sends one copy per (token, destination) and has no capacity path"),
    Refusal("expert_tensor_parallel_size", lambda c: c.expert_tensor_parallel_size > 1,
            "it has no TP all-gather / reduce-scatter"),
    Refusal("moe_token_dispatcher_type", lambda c: c.moe_token_dispatcher_type != "alltoall",
            "it extends Megatron's alltoall dispatcher"),
    *_ROW_REFUSES,
    Refusal("moe_dispatch_ranks_per_node",
            lambda c: c.expert_model_parallel_size % (c.moe_dispatch_ranks_per_node
                                                      or c.expert_model_parallel_size) != 0,
            "a node size must divide the EP size"),
)

DISPATCHERS: Dict[str, Dispatcher] = {d.name: d for d in (
    Dispatcher("alltoall", None, _ROWS_WITH_VIEWS),
    Dispatcher("dedup_rank", "rank", _DEDUP_REFUSES),
    Dispatcher("dedup_node", "node", _DEDUP_REFUSES),
)}
DISPATCHER_NAMES: Tuple[str, ...] = tuple(DISPATCHERS)
DEFAULT_DISPATCHER = "alltoall"


def get_dispatcher(name: str) -> Dispatcher:
    """The dispatcher called `name`; a ValueError naming `moe_dispatcher` otherwise."""
    require(name in DISPATCHERS, "moe_dispatcher", f"unknown dispatcher {name!r}",
            f"use one of {DISPATCHER_NAMES}")
    return DISPATCHERS[name]


def check_dispatcher(config) -> Dispatcher:
    """The config's dispatcher, after refusing an unsupported (dispatcher, variant) or
    (dispatcher, feature) pair with one error naming both and the alternative."""
    dispatcher = get_dispatcher(config.moe_dispatcher)
    variant = config.moe_variant
    if variant not in dispatcher.variants:
        others = [d.name for d in DISPATCHERS.values() if variant in d.variants]
        fix = (f"use moe_dispatcher in {others}, or one of those variants" if others else
               f"leave moe_dispatcher={DEFAULT_DISPATCHER!r} (moe_variant={variant!r} has "
               "no routed experts)")
        raise ValueError(
            f"moe_dispatcher: {dispatcher.name!r} does not dispatch moe_variant={variant!r} "
            f"(it supports {dispatcher.variants}). Fix: {fix}")
    check_refusals(config, dispatcher)
    return dispatcher


def check_refusals(config, dispatcher: Dispatcher) -> None:
    """Refuse a feature `dispatcher` cannot run with (the config's variant decides the
    refusals for mixed views); one line naming both and the fix."""
    mixes_views = get_variant(getattr(config, "moe_variant", "smoe")).multi_view
    for refusal in dispatcher.refuses:
        if refusal.refused(config) and (mixes_views or not refusal.only_mixing_views):
            other = ("" if dispatcher.name == DEFAULT_DISPATCHER else
                     f"use moe_dispatcher={DEFAULT_DISPATCHER!r}, or ")
            raise ValueError(
                f"moe_dispatcher: {dispatcher.name!r} refuses {refusal.field}="
                f"{getattr(config, refusal.field)!r} ({refusal.why}). Fix: {other}unset "
                f"{refusal.field}")
