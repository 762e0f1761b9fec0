"""The counted all-to-all measurement (`tools/a2a_volume.py`'s default mode): a real forward +
backward of the tiny GPT models at EP ranks on gloo under the collective counter, per
(variant, Megatron dispatcher, dispatch semantics), set against the analytic bytes.

Design choices:
- Each model is the trainer's own chunk (`models/build.build_model`, no DDP or optimizer),
  configured through the registries only: the Megatron dispatcher by
  `model.extra.moe_token_dispatcher_type`, the dedup semantics by `model.moe_dispatcher`.
- Checks are exact integer equalities: per rank, phase, direction and payload counted ==
  analytic (`volume.checks`, row semantics), and per link (self / intra-node / inter-node,
  `ranks_per_node` ranks per simulated node) counted == `semantics.link_bytes`.
- A refused pair (e.g. Multi-View with the allgather dispatcher) is a result with its
  error, plus what it would have cost (`analytic_if_allowed`).
- The routing shape (experts, top-k, views, latent width) is a flag over the presets, so
  every dedup mode is reachable: Multi-View sends a (token, destination) pair as its K views
  only when views + weights are strictly smaller than the n blends (`views_are_cheaper`),
  which at the tiny L = 32 fp32, K = 2 needs n >= 3 experts of one token on one destination
  (e.g. --num-experts 16 --topk 6 at EP 4); `views_pairs` counts the pairs that took it.
- Every figure states payload (float rows, probs, mixing weights) and bookkeeping (int64
  split counts, expert ids, (n, mode) pairs; the row dispatcher's tokens-per-expert counts)
  side by side: `link_bytes_mean` per link, `ratios` (token rows) and
  `ratios_with_bookkeeping` (everything the dispatch side sends, forward).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_mvmoe.config.variants import get_variant

VARIANT_PRESETS = {"latent": "tiny_latent", "multi_router": "tiny_multi_router",
                   "multi_view": "tiny_multi_view", "mh_moe": "tiny_mh_moe",
                   "smoe": "tiny_smoe"}
"""The variants measured and the tiny preset each is measured on."""


@dataclass(frozen=True)
class CountedConfig:
    """What the counted mode measures."""

    ep: Sequence[int] = (2, 4)
    """EP sizes (= ranks)."""
    variants: Sequence[str] = tuple(VARIANT_PRESETS)
    dispatchers: Sequence[str] = ("alltoall", "allgather")
    """Megatron dispatchers."""
    semantics: Sequence[str] = ("row",)
    """row = Megatron's alltoall rows; rank / node = the dedup dispatcher."""
    gpus_per_node: Optional[int] = None
    """EP ranks per simulated node (None: 2)."""
    batch_size: int = 2
    """Sequences per rank."""
    seq_length: int = 16
    brief: bool = False
    """Keep only failing checks and no per-layer rows."""
    num_experts: Optional[int] = None
    """E over the presets' 4 (None: the preset's)."""
    topk: Optional[int] = None
    """Top-k over the presets' 2."""
    num_views: Optional[int] = None
    """Multi-View's K over the preset's 2."""
    latent_size: Optional[int] = None
    """L of the latent variants over the presets' 32."""

    def model_overrides(self, variant: str) -> Dict:
        """The routing-shape overrides that apply to `variant`'s preset."""
        record = get_variant(variant)
        out = {"model.num_experts": self.num_experts, "model.moe_router_topk": self.topk}
        if record.latent:
            out["model.latent_size"] = self.latent_size
        if record.multi_view:
            out["model.multi_view.num_views"] = self.num_views
        return {k: v for k, v in out.items() if v is not None}


def measure_counted(cfg: CountedConfig, timeout_s: float = 600.0) -> Dict:
    """Every EP size of `cfg` on that many local gloo ranks: {"results", "ratios",
    "all_exact"}."""
    from megatron_mvmoe.launch.local_ranks import run_distributed

    results: List[Dict] = []
    for ep in cfg.ep:
        per_rank = run_distributed(_rank, ep, timeout_s=timeout_s, args=(cfg,))
        results += combine_ranks(ep, per_rank, cfg)
    out = {"results": results, "ratios": ratios_to_latent(results),
           "ratios_with_bookkeeping": ratios_to_latent(results, _dispatch_side_bytes),
           "all_exact": all(e.get("all_exact", True) for e in results)}
    if cfg.brief:
        _brief(results)
    return out


def counted_problem(cfg: CountedConfig) -> Optional[str]:
    """EP sizes the tiny models cannot use, or a selection that measures nothing."""
    from megatron_mvmoe.config.presets import PRESETS as MODEL_PRESETS

    experts = {cfg.num_experts or MODEL_PRESETS[VARIANT_PRESETS[v]]["num_experts"]
               for v in cfg.variants}
    topk = cfg.topk or 2
    if cfg.num_experts is not None and not 1 <= topk <= cfg.num_experts:
        return (f"--topk {topk}: must be between 1 and --num-experts {cfg.num_experts}. Fix: "
                "lower --topk or raise --num-experts")
    bad = sorted({ep for ep in cfg.ep for e in experts if ep < 1 or e % ep})
    if bad:
        fits = [d for d in range(1, min(experts) + 1) if all(e % d == 0 for e in experts)]
        return (f"--ep {' '.join(map(str, bad))}: the tiny models have {min(experts)} experts, "
                f"which do not divide over {bad[0]} ranks. Fix: use --ep from {fits} "
                "(or set --num-experts)")
    if not list(runs(cfg)):
        return (f"--semantics {' '.join(cfg.semantics)}: the dedup semantics (rank, node) run "
                "only with the alltoall dispatcher. Fix: add alltoall to --dispatchers or row "
                "to --semantics")
    return None


def _measure_one(variant, dispatcher, semantics, ep, cfg, pg):
    """Forward + backward of one model on this rank under the counter."""
    import torch

    from megatron_mvmoe.analysis.a2a.counter import count_collectives
    from megatron_mvmoe.models.build import build_model
    from megatron_mvmoe.toolkit import checkpoint, heldout

    overrides = {"model.seq_length": cfg.seq_length,
                 "model.extra": {"moe_token_dispatcher_type": dispatcher},
                 **cfg.model_overrides(variant)}
    if semantics != "row":  # the registry's dedup dispatcher, chosen by the config
        if get_variant(variant).multi_head:
            raise ValueError("semantics: no dedup model for MH-MoE sub-tokens")
        overrides.update({"model.moe_dispatcher": f"dedup_{semantics}",
                          "model.moe_dispatch_ranks_per_node": ranks_per_node(cfg, ep)})
    run = checkpoint.run_config(VARIANT_PRESETS[variant], overrides=overrides)
    run.parallel.ep = ep
    model = build_model(run, pg)[0].train()  # the trainer's chunk, without DDP/optimizer
    rank = torch.distributed.get_rank()
    batch = heldout.synthetic_batches(1, cfg.batch_size, cfg.seq_length,
                                      run.model.vocab_size, seed=rank)[0]
    with count_collectives(model) as counter:
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.float().mean().backward()
    config = model.config
    shape = dict(tokens=cfg.batch_size * cfg.seq_length, hidden=config.hidden_size,
                 topk=config.moe_router_topk, latent=config.latent_size,
                 heads=config.multi_head.num_heads, dtype_bytes=loss.new_empty(
                     0, dtype=config.params_dtype).element_size(),
                 ep=ep, tp=1, experts=config.num_moe_experts)
    maps = {name: module.token_dispatcher.routing_map.clone()
            for name, module in model.named_modules()
            if getattr(getattr(module, "token_dispatcher", None), "routing_map", None)
            is not None}
    return counter.records, shape, maps, config.multi_view.num_views


def ranks_per_node(cfg: CountedConfig, ep: int) -> int:
    """EP ranks per simulated node at EP = `ep`."""
    return min(ep, cfg.gpus_per_node or 2)


def runs(cfg: CountedConfig) -> Iterator[Tuple[str, str, str]]:
    """(variant, dispatcher, semantics) measured; the dedup semantics only with alltoall."""
    for dispatcher in cfg.dispatchers:
        for semantics in cfg.semantics:
            if semantics != "row" and dispatcher != "alltoall":
                continue
            for variant in cfg.variants:
                yield variant, dispatcher, semantics


def _rank(rank: int, world_size: int, cfg: CountedConfig) -> Dict:
    """On each rank: every run of `cfg` under the counter (errors kept per run)."""
    from megatron_mvmoe.analysis.a2a.volume import peer_counts, rank_counts
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    out = {}
    for key in runs(cfg):
        if rank == 0:
            print(f"[a2a_volume] EP={world_size} {key[1]} {key[2]} {key[0]}", file=sys.stderr,
                  flush=True)
        pg = initialize_layout(ParallelLayout(ep=world_size))
        try:
            records, shape, maps, views = _measure_one(*key, world_size, cfg, pg)
            out[key] = {"counts": rank_counts(records), "peers": peer_counts(records),
                        "shape": shape, "maps": maps, "views": views}
        except (ValueError, NotImplementedError) as err:
            out[key] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            destroy_layout()
    return out


def _link_checks(variant, semantics, ep, cfg, first, per_rank, key):
    import torch

    from megatron_mvmoe.a2a_model.semantics import (link_bytes, payload_and_bookkeeping,
                                                            payload_for_variant, sent_by_link,
                                                            views_pairs)
    from megatron_mvmoe.a2a_model.placement import EpPlacement
    from megatron_mvmoe.analysis.a2a.volume import semantic_checks

    s = first["shape"]
    placement = EpPlacement(ep, ranks_per_node(cfg, ep), s["experts"])
    payload = payload_for_variant(variant, s["hidden"], s["latent"], first["views"],
                                  s["dtype_bytes"])
    found, links, views = [], {}, 0
    for layer in sorted(first["maps"]):
        maps = torch.stack([r[key]["maps"][layer] for r in per_rank])
        analytic = link_bytes(maps, placement, payload, semantics)
        found += semantic_checks(analytic, placement,
                                 [r[key]["peers"].get(layer, {}) for r in per_rank], layer)
        links[layer] = {}
        for part, matrix in payload_and_bookkeeping(analytic).items():
            suffix = "" if part == "payload" else "_bookkeeping"
            links[layer].update({link + suffix: float(v.double().mean())
                                 for link, v in sent_by_link(matrix, placement).items()})
        views += views_pairs(maps, placement, payload, semantics)
    return found, links, views


def combine_ranks(ep, per_rank, cfg):
    from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes
    from megatron_mvmoe.analysis.a2a.volume import checks, per_layer_rows

    results = []
    for key, first in per_rank[0].items():
        variant, dispatcher, semantics = key
        entry = {"ep": ep, "variant": variant, "dispatcher": dispatcher, "semantics": semantics}
        if "error" in first:
            entry["error"] = first["error"]
            if get_variant(variant).multi_view and dispatcher == "allgather":
                entry["analytic_if_allowed"] = _refused_cost(per_rank[0], ep)
            results.append(entry)
            continue
        shape = CommShape(**first["shape"])
        counts = [r[key]["counts"] for r in per_rank]
        found = checks(variant, dispatcher, shape, counts) if semantics == "row" else []
        links, views = {}, 0
        if dispatcher == "alltoall" and not get_variant(variant).multi_head:
            extra, links, views = _link_checks(variant, semantics, ep, cfg, first, per_rank,
                                               key)
            found += extra
        volume = dispatch_bytes(variant, dispatcher, shape)
        entry.update(shape=first["shape"], analytic_tokens_in=volume.tokens_in,
                     analytic_probs_in=volume.probs_in, rows=per_layer_rows(counts),
                     link_bytes_mean=links, views_pairs=views,
                     checks=[c.as_dict() for c in found],
                     checks_total=len(found), checks_exact=sum(c.ok for c in found),
                     all_exact=bool(found) and all(c.ok for c in found))
        results.append(entry)
    return results


def _brief(results: List[Dict]) -> None:
    """Keep only the failing checks and no per-layer rows (after the ratios used them)."""
    for entry in results:
        if "checks" in entry:
            entry["checks"] = [c for c in entry["checks"] if not c["ok"]]
        entry.pop("rows", None)


def _refused_cost(rank0, ep):
    from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes

    base = rank0.get(("latent", "allgather", "row"), {}).get("shape")
    if base is None:
        return None
    volume = dispatch_bytes("multi_view", "allgather", CommShape(**base))
    return {"tokens_in": volume.tokens_in, "note": volume.note}


def _forward_dispatch_tokens(entry) -> float:
    return sum(r["bytes_per_rank"] for r in entry.get("rows", [])
               if r["phase"] == "token_dispatch" and r["direction"] == "fwd"
               and r["payload"] == "tokens")


def _dispatch_side_bytes(entry) -> float:
    """Everything one rank hands to the dispatch side's collectives in forward: rows, probs,
    mixing weights and the int64 bookkeeping (split counts, expert ids, (n, mode))."""
    return sum(r["bytes_per_rank"] for r in entry.get("rows", [])
               if r["direction"] == "fwd" and (r["phase"] == "token_dispatch"
                                                or r["phase"].startswith("dispatch_preprocess")))


def ratios_to_latent(results, measure=_forward_dispatch_tokens):
    """Counted `measure` (default: forward-dispatch token rows) of each variant / the latent
    baseline at the same EP, dispatcher and semantics."""
    out = {}
    for entry in results:
        if entry["dispatcher"] != "alltoall":
            continue
        base = next((e for e in results if e["variant"] == "latent" and e["ep"] == entry["ep"]
                     and e["dispatcher"] == entry["dispatcher"] and "rows" in e
                     and e["semantics"] == entry["semantics"]), None)
        if base and "rows" in entry and measure(base):
            sem = "" if entry["semantics"] == "row" else f"/{entry['semantics']}"
            out[f"ep{entry['ep']}/{entry['dispatcher']}{sem}/{entry['variant']}"] = round(
                measure(entry) / measure(base), 6)
    return out


def counted_plot(results: List[Dict], path: str, cfg: CountedConfig) -> str:
    """PNG of the first MoE layer's forward dispatch bytes per link, one panel per EP."""
    from megatron_mvmoe.analysis.plots import plot_link_bytes

    panels = {}
    for e in results:
        per_layer = e.get("link_bytes_mean") or {}
        if per_layer:
            first = per_layer[sorted(per_layer)[0]]
            title = f"EP={e['ep']}, {ranks_per_node(cfg, e['ep'])} ranks per node"
            panels.setdefault(title, []).append(
                {"label": f"{e['semantics']} {e['variant']}", **first})
    return plot_link_bytes(panels, path, "tiny GPT, first MoE layer: forward dispatch payload "
                           "bytes per rank (rows + probs + weights; the int64 bookkeeping is "
                           "in the JSON; analytic = counted)")
