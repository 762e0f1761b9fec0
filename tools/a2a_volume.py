#!/usr/bin/env python
"""Bytes each MoE collective moves per layer and direction, counted and analytic, and the
10B-A1B all-to-all at cluster scale.

Counted mode (default): a real forward + backward of the tiny GPT models at EP = 2 and 4
(gloo ranks on CPU) under the collective counter, for baseline latent, Multi-Router,
Multi-View, MH-MoE and SMoE, alltoall and allgather, and with --semantics rank / node the
dedup dispatcher (one copy per (token, destination rank) / per destination node forwarded
inside the node; Multi-View sends blends or views + weights, whichever is smaller).
Checks are exact integer equalities: the alltoall / allgather checks of before, and per
rank, phase, direction, payload and link (self / intra-node / inter-node, --gpus-per-node
ranks per simulated node) counted == analytic (analysis.dispatch_semantics) for every
semantic.

Scale mode (--scale): the 10B-A1B preset on its 8 / 64 / 256-GPU layouts, routing drawn
balanced (Megatron's force-load-balancing), skewed (Zipf, --load) or from a trained
checkpoint's load profile; bytes split intra / inter-node, time = max over ranks of
intra / NVLink + inter / network bandwidth, share of step time against analytic FLOPs.
--markdown writes the results page, --plot the stacked intra / inter bytes.

Examples:
  python tools/a2a_volume.py --ep 2 4 --semantics row rank node --json > a2a.json
  python tools/a2a_volume.py --scale --routing checkpoint balanced skewed \\
      --checkpoint runs/main_job/checkpoints --markdown examples/results/a2a_at_scale.md \\
      --plot examples/results/a2a_at_scale.png --json
"""

from __future__ import annotations

import sys
import time

from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.toolkit import flags, output

PRESETS = {"latent": "tiny_latent", "multi_router": "tiny_multi_router",
           "multi_view": "tiny_multi_view", "mh_moe": "tiny_mh_moe", "smoe": "tiny_smoe"}
ROUTING = ("checkpoint", "balanced", "skewed")


def parse_args(argv=None):
    p = flags.tool_parser(__doc__)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="counted: EP sizes (= ranks)")
    p.add_argument("--variants", nargs="+", default=list(PRESETS), choices=list(PRESETS),
                   help="counted: model variants")
    p.add_argument("--dispatchers", nargs="+", default=["alltoall", "allgather"],
                   choices=["alltoall", "allgather"], help="counted: Megatron dispatchers")
    p.add_argument("--semantics", nargs="+", default=["row"], choices=["row", "rank", "node"],
                   help="counted: dispatch semantics (row = Megatron's alltoall rows; rank / "
                        "node = the dedup dispatcher); link checks for each")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="EP ranks per node (counted default 2: simulated nodes; scale "
                        "default 8)")
    p.add_argument("--batch-size", type=int, default=2, help="counted: sequences per rank")
    p.add_argument("--seq-length", type=int, default=16, help="counted: tokens per sequence")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per spawned run")
    p.add_argument("--scale", action="store_true", help="the 10B-A1B cluster-scale table")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256],
                   help="scale: cluster sizes (layouts from config.presets.LAYOUTS_10B)")
    p.add_argument("--routing", nargs="+", default=None, choices=ROUTING,
                   help="scale: routing models (default skewed; checkpoint needs "
                        "--checkpoint)")
    p.add_argument("--load", type=float, default=1.0,
                   help="scale: Zipf exponent s of the skewed routing (p_e ~ 1/(r+1)^s)")
    p.add_argument("--checkpoint", default=None,
                   help="scale: trained checkpoint dir for --routing checkpoint")
    p.add_argument("--heldout-batches", type=int, default=4,
                   help="scale: held-out batches per domain routed through the checkpoint")
    p.add_argument("--micro-batch-size", type=int, default=1, help="scale: sequences per rank")
    p.add_argument("--nvlink-gbps", type=float, default=370.0,
                   help="scale: achieved intra-node GB/s per direction (NVLink4 450 "
                        "datasheet, ~370 NCCL)")
    p.add_argument("--network-gbps", type=float, default=48.0,
                   help="scale: achieved inter-node GB/s per GPU (NDR 400 Gb/s = 50 GB/s)")
    p.add_argument("--achieved-tflops", type=float, default=400.0,
                   help="scale: achieved bf16 TFLOP/s per GPU for the compute time")
    p.add_argument("--seed", type=int, default=0, help="scale: routing sampling seed")
    p.add_argument("--markdown", default=None, help="scale: write the results page here")
    p.add_argument("--counted-json", default=None,
                   help="scale: a counted-mode --json output to summarise on the page")
    p.add_argument("--plot", default=None, help="PNG of stacked intra / inter bytes")
    p.add_argument("--brief", action="store_true",
                   help="counted: keep only failing checks and no per-layer rows in the JSON")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return p.parse_args(argv)


# Flags that only the scale mode reads (None = not given).
_SCALE_ONLY = ("--routing", "--checkpoint", "--markdown", "--counted-json")


def _scale_flag_problem(args):
    """A scale-mode flag in counted mode, or a checkpoint the scale mode cannot use."""
    given = [f for f in _SCALE_ONLY if getattr(args, f[2:].replace("-", "_")) is not None]
    if not args.scale:
        return (f"{given[0]}: a --scale flag, unused in counted mode. Fix: add --scale or "
                f"drop {given[0]}") if given else None
    routing = args.routing or ["skewed"]
    if "checkpoint" in routing and not args.checkpoint:
        return ("--routing checkpoint needs --checkpoint DIR (e.g. runs/main_job/checkpoints "
                "from `make run`)")
    if args.checkpoint and "checkpoint" not in routing:
        return (f"--checkpoint {args.checkpoint}: read only with --routing checkpoint. Fix: "
                "add checkpoint to --routing, or drop --checkpoint")
    if args.checkpoint:
        from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
        from megatron_mvmoe.checkpointing.errors import CheckpointError
        try:
            resolve_checkpoint(args.checkpoint, flag="--checkpoint", missing_fix=(
                "pass a checkpoint written by training: its --save root (e.g. "
                "runs/main_job/checkpoints) or one of its iter_* directories"))
        except CheckpointError as err:
            return str(err)
    return None


def _counted_problem(args):
    """EP sizes the tiny models cannot use, or a selection that measures nothing."""
    from megatron_mvmoe.config.presets import PRESETS as MODEL_PRESETS

    experts = {MODEL_PRESETS[PRESETS[v]]["num_experts"] for v in args.variants}
    bad = sorted({ep for ep in args.ep for e in experts if ep < 1 or e % ep})
    if bad:
        fits = [d for d in range(1, min(experts) + 1) if all(e % d == 0 for e in experts)]
        return (f"--ep {' '.join(map(str, bad))}: the tiny models have {min(experts)} experts, "
                f"which do not divide over {bad[0]} ranks. Fix: use --ep from {fits}")
    if not list(_runs(args)):
        return (f"--semantics {' '.join(args.semantics)}: the dedup semantics (rank, node) run "
                "only with the alltoall dispatcher. Fix: add alltoall to --dispatchers or row "
                "to --semantics")
    return None


def _progress(message: str) -> None:
    print(f"[a2a_volume] {message}", file=sys.stderr, flush=True)


# ---- counted mode ----------------------------------------------------------------------------
def _measure_one(variant, dispatcher, semantics, ep, args, pg):
    """Forward + backward of one model on this rank under the counter."""
    import torch

    from megatron_mvmoe.toolkit import checkpoint, heldout
    from megatron_mvmoe.analysis.a2a.counter import count_collectives
    from megatron_mvmoe.models.build import build_model

    overrides = {"model.seq_length": args.seq_length,
                 "model.extra": {"moe_token_dispatcher_type": dispatcher}}
    if semantics != "row":  # the registry's dedup dispatcher, chosen by the config
        if get_variant(variant).multi_head:
            raise ValueError("semantics: no dedup model for MH-MoE sub-tokens")
        overrides.update({"model.moe_dispatcher": f"dedup_{semantics}",
                          "model.moe_dispatch_ranks_per_node": _counted_node(args, ep)})
    run = checkpoint.run_config(PRESETS[variant], overrides=overrides)
    run.parallel.ep = ep
    model = build_model(run, pg)[0].train()  # the trainer's chunk, without DDP/optimizer
    rank = torch.distributed.get_rank()
    batch = heldout.synthetic_batches(1, args.batch_size, args.seq_length,
                                      run.model.vocab_size, seed=rank)[0]
    with count_collectives(model) as counter:
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.float().mean().backward()
    config = model.config
    shape = dict(tokens=args.batch_size * args.seq_length, hidden=config.hidden_size,
                 topk=config.moe_router_topk, latent=config.latent_size,
                 heads=config.multi_head.num_heads, dtype_bytes=loss.new_empty(
                     0, dtype=config.params_dtype).element_size(),
                 ep=ep, tp=1, experts=config.num_moe_experts)
    maps = {name: module.token_dispatcher.routing_map.clone()
            for name, module in model.named_modules()
            if getattr(getattr(module, "token_dispatcher", None), "routing_map", None)
            is not None}
    return counter.records, shape, maps, config.multi_view.num_views


def _counted_node(args, ep) -> int:
    return min(ep, args.gpus_per_node or 2)


def _runs(args):
    for dispatcher in args.dispatchers:
        for semantics in args.semantics:
            if semantics != "row" and dispatcher != "alltoall":
                continue
            for variant in args.variants:
                yield variant, dispatcher, semantics


def _rank(rank, world_size, args):
    from megatron_mvmoe.analysis.a2a.volume import peer_counts, rank_counts
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    out = {}
    for key in _runs(args):
        if rank == 0:
            _progress(f"EP={world_size} {key[1]} {key[2]} {key[0]}")
        pg = initialize_layout(ParallelLayout(ep=world_size))
        try:
            records, shape, maps, views = _measure_one(*key, world_size, args, pg)
            out[key] = {"counts": rank_counts(records), "peers": peer_counts(records),
                        "shape": shape, "maps": maps, "views": views}
        except (ValueError, NotImplementedError) as err:
            out[key] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            destroy_layout()
    return out


def _link_checks(variant, semantics, ep, args, first, per_rank, key):
    import torch

    from megatron_mvmoe.analysis.a2a.semantics import (link_bytes, payload_for_variant,
                                                            sent_by_link)
    from megatron_mvmoe.analysis.a2a.placement import EpPlacement
    from megatron_mvmoe.analysis.a2a.volume import semantic_checks

    s = first["shape"]
    placement = EpPlacement(ep, _counted_node(args, ep), s["experts"])
    payload = payload_for_variant(variant, s["hidden"], s["latent"], first["views"],
                                  s["dtype_bytes"])
    found, links = [], {}
    for layer in sorted(first["maps"]):
        maps = torch.stack([r[key]["maps"][layer] for r in per_rank])
        analytic = link_bytes(maps, placement, payload, semantics)
        found += semantic_checks(analytic, placement,
                                 [r[key]["peers"].get(layer, {}) for r in per_rank], layer)
        fwd = analytic[("token_dispatch", "fwd", "tokens")] + analytic[
            ("token_dispatch", "fwd", "probs")]
        split = sent_by_link(fwd, placement)
        links[layer] = {k: float(v.double().mean()) for k, v in split.items()}
    return found, links


def _combine(ep, per_rank, args):
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
        links = {}
        if dispatcher == "alltoall" and not get_variant(variant).multi_head:
            extra, links = _link_checks(variant, semantics, ep, args, first, per_rank, key)
            found += extra
        volume = dispatch_bytes(variant, dispatcher, shape)
        entry.update(shape=first["shape"], analytic_tokens_in=volume.tokens_in,
                     analytic_probs_in=volume.probs_in, rows=per_layer_rows(counts),
                     link_bytes_mean=links, checks=[c.as_dict() for c in found],
                     checks_total=len(found), checks_exact=sum(c.ok for c in found),
                     all_exact=bool(found) and all(c.ok for c in found))
        if args.brief:  # keep the failures only
            entry["checks"] = [c for c in entry["checks"] if not c["ok"]]
            entry.pop("rows")
        results.append(entry)
    return results


def _refused_cost(rank0, ep):
    from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes

    base = rank0.get(("latent", "allgather", "row"), {}).get("shape")
    if base is None:
        return None
    volume = dispatch_bytes("multi_view", "allgather", CommShape(**base))
    return {"tokens_in": volume.tokens_in, "note": volume.note}


def _ratios(results):
    """Counted forward-dispatch token bytes of each variant / the latent baseline."""
    def fwd(entry):
        return sum(r["bytes_per_rank"] for r in entry.get("rows", [])
                   if r["phase"] == "token_dispatch" and r["direction"] == "fwd"
                   and r["payload"] == "tokens")

    out = {}
    for entry in results:
        if entry["dispatcher"] != "alltoall":
            continue
        base = next((e for e in results if e["variant"] == "latent" and e["ep"] == entry["ep"]
                     and e["dispatcher"] == entry["dispatcher"] and "rows" in e
                     and e["semantics"] == entry["semantics"]), None)
        if base and "rows" in entry and fwd(base):
            sem = "" if entry["semantics"] == "row" else f"/{entry['semantics']}"
            out[f"ep{entry['ep']}/{entry['dispatcher']}{sem}/{entry['variant']}"] = round(
                fwd(entry) / fwd(base), 6)
    return out


def _summary(payload) -> str:
    lines = []
    for e in payload["results"]:
        head = f"EP={e['ep']} {e['dispatcher']:9s} {e['semantics']:4s} {e['variant']:13s}"
        if "error" in e:
            lines.append(f"{head} refused: {e['error'][:100]}")
            continue
        bad = [c for c in e["checks"] if not c["ok"]]
        lines.append(f"{head} analytic dispatch/rank {e['analytic_tokens_in']:>7d} B  "
                     f"checks {e['checks_exact']}/{e['checks_total']} exact")
        for c in bad:
            lines.append(f"    MISMATCH {c['layer']} {c['what']}: counted {c['counted']} "
                         f"analytic {c['analytic']}")
    ratios = ", ".join(f"{k}={v:.3f}" for k, v in payload["ratios"].items())
    lines.append("ratio to latent baseline (forward dispatch bytes): " + (ratios or (
        "none: a ratio needs the latent baseline measured with the alltoall dispatcher at the "
        "same EP and semantics (add latent to --variants and alltoall to --dispatchers)")))
    return "\n".join(lines)


def _counted_plot(results, path, args):
    from megatron_mvmoe.analysis.plots import plot_link_bytes

    panels = {}
    for e in results:
        per_layer = e.get("link_bytes_mean") or {}
        if per_layer:
            first = per_layer[sorted(per_layer)[0]]
            title = f"EP={e['ep']}, {_counted_node(args, e['ep'])} ranks per node"
            panels.setdefault(title, []).append(
                {"label": f"{e['semantics']} {e['variant']}", **first})
    return plot_link_bytes(panels, path, "tiny GPT, first MoE layer: forward dispatch bytes "
                           "per rank (analytic = counted)")


def main_counted(args) -> int:
    from megatron_mvmoe.launch.local_ranks import run_distributed

    start = time.time()
    results = []
    for ep in args.ep:
        per_rank = run_distributed(_rank, ep, timeout_s=args.timeout, args=(args,))
        results += _combine(ep, per_rank, args)
    payload = {"results": results, "ratios": _ratios(results),
               "all_exact": all(e.get("all_exact", True) for e in results),
               "wall_s": round(time.time() - start, 1),
               "command": " ".join(["python", "tools/a2a_volume.py", *sys.argv[1:]])}
    if args.plot:
        payload["plot"] = _counted_plot(results, args.plot, args)
    output.emit(payload, args.json, _summary(payload))
    return 0 if payload["all_exact"] else 1


# ---- scale mode ------------------------------------------------------------------------------
def main_scale(args) -> int:
    from megatron_mvmoe.analysis.a2a import report as a2a_report
    from megatron_mvmoe.analysis.a2a.scale import ScaleConfig, config_dict, scale_rows
    from megatron_mvmoe.analysis.a2a.link_time import LinkSpec

    start = time.time()
    payload = {"mode": "scale", "runs": [],
               "command": " ".join(["python", "tools/a2a_volume.py", *sys.argv[1:]])}
    links = LinkSpec(args.nvlink_gbps, args.network_gbps)
    for routing in args.routing:
        shares = None
        if routing == "checkpoint":
            shares, payload["checkpoint"] = _checkpoint_profile(args)
        cfg = ScaleConfig(tuple(args.gpus), args.gpus_per_node or 8, args.micro_batch_size,
                          routing="profile" if routing == "checkpoint" else routing,
                          load=args.load, shares=shares, links=links,
                          achieved_tflops=args.achieved_tflops, seed=args.seed)
        rows = scale_rows(cfg, _progress)
        payload["runs"].append({"routing": routing, "config": config_dict(cfg), "rows": rows})
    payload["wall_s"] = round(time.time() - start, 1)
    if args.plot:
        payload["plot"] = a2a_report.plot(payload, args.plot)
    if args.markdown:
        payload["markdown"] = a2a_report.write_page(payload, args.markdown, args.counted_json)
    output.emit(payload, args.json, a2a_report.text_summary(payload))
    return 0


def _checkpoint_profile(args):
    from megatron_mvmoe.analysis.a2a.scale import tiny_real_routing_rows
    from megatron_mvmoe.analysis.routing.checkpoint_routing import checkpoint_routing, load_profile

    _progress(f"routing held-out text through {args.checkpoint}")
    found = checkpoint_routing(args.checkpoint, args.heldout_batches, seed=args.seed)
    shares = load_profile(found["maps"])
    tiny = tiny_real_routing_rows(found["maps"], found["hidden"], found["latent"],
                                  found["views"])
    info = {k: found[k] for k in ("variant", "data")}
    info["path"] = args.checkpoint
    info.update(tokens=int(next(iter(found["maps"].values())).shape[0]),
                load_profile=shares, tiny_real_routing=tiny)
    return shares, info


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _scale_flag_problem(args) or (None if args.scale else _counted_problem(args))
    if problem:  # one line, before any rank is spawned
        return _fail(problem)
    args.routing = args.routing or ["skewed"]
    try:
        return main_scale(args) if args.scale else main_counted(args)
    except ValueError as err:
        return _fail(str(err))


if __name__ == "__main__":
    sys.exit(main())
