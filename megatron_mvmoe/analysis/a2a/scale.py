"""The 10B-A1B all-to-all at cluster scale: bytes per MoE layer and rank under each dispatch
semantic, time against the link limits and share of step time, for the baseline (latent),
Multi-Router and Multi-View, next to naive Multi-View and the allgather dispatcher:
`scale_rows(ScaleConfig(...))`.

Design choices:
- Shapes come from the presets in code (`mvmoe_10b_a1b_baseline`, `mvmoe_10b_a1b` and
  Multi-Router = mvmoe_10b_a1b with moe_variant multi_router) and the layouts from
  `LAYOUTS_10B`, so the table follows any change of the preset.
- Tokens per EP rank and micro-batch: seq x micro-batch / TP (the sequence-parallel slice
  each rank routes); EP placement: `EpPlacement.for_layout` (ETP = 1).
- One routing map set per cluster size, shared by every variant: the comparison is of what
  each variant must send for the same routing, not of routers' choices.
- Compute per GPU and micro-batch: analytic training FLOPs per token (config.model_costs) x
  seq x micro-batch / (TP x PP) at the stated achieved TFLOP/s; all-to-all per GPU and
  micro-batch: (layers / PP) x the layer's four collectives (dispatch and combine, forward
  and backward), each the max over ranks (analysis.a2a.link_time); no overlap.
- Bytes count everything a dispatcher sends (`semantics.link_bytes`): intra / inter include
  the int64 bookkeeping, stated beside them (`bookkeeping_bytes_mean`), and the ratios are
  given with it (`bytes_ratio`) and for the float payload alone (`payload_ratio`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_mvmoe.a2a_model.semantics import (SEMANTICS, allgather_link_bytes,
                                                        link_bytes, payload_and_bookkeeping,
                                                        payload_for_variant, received_by_link,
                                                        sent_by_link)
from megatron_mvmoe.analysis.a2a.link_time import LinkSpec, a2a_share, compute_time_s, \
    layer_a2a_time_s
from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.config.model_costs import flops_per_token
from megatron_mvmoe.analysis.routing.rank_load import max_over_mean, rank_loads, routing_maps
from megatron_mvmoe.config.model_section import ModelSection, model_from_preset
from megatron_mvmoe.config.presets import LAYOUTS_10B

VARIANTS = {"baseline": ("mvmoe_10b_a1b_baseline", {}),
            "multi_router": ("mvmoe_10b_a1b", {"moe_variant": "multi_router",
                                               "multi_view": {"num_views": 1}}),
            "multi_view": ("mvmoe_10b_a1b", {})}
"""Table variant -> (preset, overrides)."""


@dataclass(frozen=True)
class ScaleConfig:
    gpus: Sequence[int] = (8, 64, 256)
    gpus_per_node: int = 8
    micro_batch_size: int = 1
    dtype_bytes: int = 2
    """bf16 rows."""
    routing: str = "skewed"
    """balanced | skewed | profile (a checkpoint's measured load profile)."""
    load: float = 1.0
    """Zipf exponent of the skewed model."""
    shares: Optional[List[float]] = None
    """Per-expert load shares for the profile model."""
    links: LinkSpec = field(default_factory=LinkSpec)
    achieved_tflops: float = 400.0
    seed: int = 0


def model_shape(variant: str) -> ModelSection:
    preset, overrides = VARIANTS[variant]
    return model_from_preset(preset, **overrides)


def _summary(matrices, placement: EpPlacement, links: LinkSpec, model: ModelSection,
             layout: Dict[str, int], micro_batch: int, tflops: float) -> dict:
    """Bytes (forward dispatch side: float payload + int64 bookkeeping, and the bookkeeping
    alone), time per layer and share of step time."""
    parts = payload_and_bookkeeping(matrices)
    dispatch = parts["payload"] + parts["bookkeeping"]
    sent, got = sent_by_link(dispatch, placement), received_by_link(dispatch, placement)
    kept = sent_by_link(parts["bookkeeping"], placement)
    times = layer_a2a_time_s(matrices, placement, links)
    layers = model.num_layers / layout["pp"]
    compute = compute_time_s(flops_per_token(model)["train"] * model.seq_length * micro_batch
                             / (layout["tp"] * layout["pp"]), tflops)
    a2a = layers * times["total"]
    return {"intra_bytes_mean": float(sent["intra"].double().mean()),
            "inter_bytes_mean": float(sent["inter"].double().mean()),
            "bookkeeping_bytes_mean": float((kept["intra"] + kept["inter"]).double().mean()),
            "max_rank_bytes": int((got["intra"] + got["inter"]).max()),
            "layer_a2a_ms": times["total"] * 1e3, "step_a2a_ms": a2a * 1e3,
            "step_compute_ms": compute * 1e3, "a2a_share": a2a_share(a2a, compute)}


def _payload(model: ModelSection, dtype_bytes: int, naive: bool = False):
    name = "multi_view" if naive else model.moe_variant
    return payload_for_variant(name, model.hidden_size, model.latent_size, model.multi_view.num_views,
                               dtype_bytes, naive=naive)


def scale_rows(cfg: ScaleConfig, progress: Callable[[str], None] = lambda _: None) -> List[dict]:
    """One row per (cluster size, semantic, variant), plus the comparison points."""
    rows: List[dict] = []
    base = model_shape("baseline")
    for gpus in cfg.gpus:
        if gpus not in LAYOUTS_10B:
            raise ValueError(f"gpus: no 10B-A1B layout for {gpus}. Fix: use one of "
                             f"{sorted(LAYOUTS_10B)}")
        layout = LAYOUTS_10B[gpus]
        placement = EpPlacement.for_layout(layout["ep"], 1, cfg.gpus_per_node, base.num_experts)
        tokens = base.seq_length * cfg.micro_batch_size // layout["tp"]
        progress(f"{gpus} GPUs (tp {layout['tp']} pp {layout['pp']} ep {layout['ep']}, "
                 f"{placement.nodes} node(s)): routing {cfg.routing} for {tokens} tokens/rank")
        maps = routing_maps(cfg.routing, layout["ep"], tokens, base.num_experts,
                            base.moe_router_topk, cfg.load, cfg.shares, cfg.seed + gpus)
        common = {"gpus": gpus, **layout, "nodes": placement.nodes, "tokens_per_rank": tokens,
                  "routing": cfg.routing,
                  "rank_load_max_over_mean": max_over_mean(rank_loads(maps, layout["ep"]))}
        for semantics in SEMANTICS:
            progress(f"  {gpus} GPUs, semantic {semantics}")
            for variant in (*VARIANTS, "naive_multi_view"):
                model = model_shape("multi_view" if variant == "naive_multi_view" else variant)
                shape = _payload(model, cfg.dtype_bytes, variant == "naive_multi_view")
                matrices = link_bytes(maps, placement, shape, semantics)
                rows.append({**common, "semantics": semantics, "variant": variant,
                             **_summary(matrices, placement, cfg.links, model, layout,
                                        cfg.micro_batch_size, cfg.achieved_tflops)})
        for variant, per_token in (("allgather_baseline", 1),
                                   ("allgather_multi_view", base.moe_router_topk)):
            model = model_shape("baseline" if per_token == 1 else "multi_view")
            matrices = allgather_link_bytes(placement, tokens,
                                            _payload(base, cfg.dtype_bytes), per_token)
            rows.append({**common, "semantics": "allgather", "variant": variant,
                         **_summary(matrices, placement, cfg.links, model, layout,
                                    cfg.micro_batch_size, cfg.achieved_tflops)})
    return _with_ratios(rows)


def _with_ratios(rows: List[dict]) -> List[dict]:
    """bytes_ratio (bookkeeping included) / payload_ratio (floats only) / time_ratio: a row
    over the baseline of its cluster size and semantic (allgather rows over the alltoall
    row-semantic baseline)."""
    def key(r):
        return r["gpus"], r["routing"], ("row" if r["semantics"] == "allgather"
                                         else r["semantics"])

    base = {key(r): r for r in rows if r["variant"] == "baseline"}
    for r in rows:
        ref = base[key(r)]
        total = r["intra_bytes_mean"] + r["inter_bytes_mean"]
        ref_total = ref["intra_bytes_mean"] + ref["inter_bytes_mean"]
        r["bytes_ratio"] = total / ref_total if ref_total else None
        payload = total - r["bookkeeping_bytes_mean"]
        ref_payload = ref_total - ref["bookkeeping_bytes_mean"]
        r["payload_ratio"] = payload / ref_payload if ref_payload else None
        r["time_ratio"] = r["layer_a2a_ms"] / ref["layer_a2a_ms"] if ref["layer_a2a_ms"] else None
    return rows


def config_dict(cfg: ScaleConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out["gpus"] = list(cfg.gpus)
    return out


def tiny_real_routing_rows(maps_TE_by_layer: Dict[str, torch.Tensor], hidden: int,
                           latent: int, views: int, eps=(2, 4), ranks_per_node: int = 2,
                           dtype_bytes: int = 2) -> List[dict]:
    """The trained tiny model's own routing maps split over EP ranks: bytes of baseline and
    Multi-View per semantic (forward dispatch side, float payload + int64 bookkeeping, over
    links: self bytes excluded, summed over ranks)."""
    rows = []
    for layer, map_TE in maps_TE_by_layer.items():
        for ep in eps:
            tokens = map_TE.shape[0] // ep
            maps = map_TE[:tokens * ep].reshape(ep, tokens, -1)
            placement = EpPlacement(ep, min(ep, ranks_per_node), map_TE.shape[1])
            for semantics in SEMANTICS:
                total = {}
                for variant in ("latent", "multi_view"):
                    shape = payload_for_variant(variant, hidden, latent, views, dtype_bytes)
                    m = link_bytes(maps, placement, shape, semantics)
                    fwd = sum(payload_and_bookkeeping(m).values())
                    split = sent_by_link(fwd, placement)
                    total[variant] = int((split["intra"] + split["inter"]).sum())
                    total[f"{variant}_inter"] = int(split["inter"].sum())
                rows.append({"layer": layer, "ep": ep, "semantics": semantics,
                             "tokens_per_rank": tokens, "baseline_bytes": total["latent"],
                             "multi_view_bytes": total["multi_view"],
                             "baseline_inter_bytes": total["latent_inter"],
                             "multi_view_inter_bytes": total["multi_view_inter"],
                             "ratio": total["multi_view"] / total["latent"]})
    return rows
