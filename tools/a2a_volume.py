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
ranks per simulated node) counted == analytic (a2a_model.semantics) for every
semantic. The routing shape is a flag (--num-experts, --topk, --num-views, --latent-size),
so every dedup mode is reachable: Multi-View sends a (token, destination) pair as its K
views only where K views + n x K weights are strictly smaller than n blends, i.e. with
n >= 3 experts of a token on one destination at the tiny L = 32 fp32, K = 2 (each result
reports `views_pairs`). Every byte a dispatcher sends is counted and modelled: payload (rows,
probs, mixing weights) and bookkeeping (int64 split counts, expert ids, (n, mode) pairs;
Megatron's tokens-per-expert all-gather), reported side by side.

Scale mode (--scale): the 10B-A1B preset on its 8 / 64 / 256-GPU layouts, routing drawn
balanced (Megatron's force-load-balancing), skewed (Zipf, --load) or from a trained
checkpoint's load profile; bytes split intra / inter-node, time = max over ranks of
intra / NVLink + inter / network bandwidth, share of step time against analytic FLOPs.
--markdown writes the results page, --plot the stacked intra / inter bytes.

Examples:
  python tools/a2a_volume.py --ep 2 4 --semantics row rank node --json > a2a.json
  python tools/a2a_volume.py --ep 2 4 --variants latent multi_view --dispatchers alltoall \
      --semantics rank node --num-experts 16 --topk 6      # views mode at EP 2 and 4
  python tools/a2a_volume.py --scale --routing checkpoint balanced skewed \\
      --checkpoint runs/main_job/checkpoints --markdown examples/results/a2a_at_scale.md \\
      --plot examples/results/a2a_at_scale.png --json
"""

from __future__ import annotations

import sys
import time

from megatron_mvmoe.analysis.a2a.counted import VARIANT_PRESETS, counted_problem
from megatron_mvmoe.toolkit import flags, output

ROUTING = ("checkpoint", "balanced", "skewed")


def parse_args(argv=None):
    p = flags.tool_parser(__doc__)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="counted: EP sizes (= ranks)")
    p.add_argument("--variants", nargs="+", default=list(VARIANT_PRESETS),
                   choices=list(VARIANT_PRESETS),
                   help="counted: model variants")
    p.add_argument("--dispatchers", nargs="+", default=["alltoall", "allgather"],
                   choices=["alltoall", "allgather"], help="counted: Megatron dispatchers")
    p.add_argument("--semantics", nargs="+", default=["row"], choices=["row", "rank", "node"],
                   help="counted: dispatch semantics (row = Megatron's alltoall rows; rank / "
                        "node = the dedup dispatcher); link checks for each")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="EP ranks per node (counted default 2: simulated nodes; scale "
                        "default 8)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="counted: experts E (default: the tiny presets' 4)")
    p.add_argument("--topk", type=int, default=None, help="counted: top-k (default 2)")
    p.add_argument("--num-views", type=int, default=None,
                   help="counted: Multi-View's K views (default 2); with --latent-size and "
                        "--topk it decides where views are cheaper than blends")
    p.add_argument("--latent-size", type=int, default=None,
                   help="counted: latent width L (default 32)")
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
    p.add_argument("--profile-json", default=None,
                   help="scale: --routing checkpoint from the load profile an earlier --json "
                        "output recorded (its checkpoint entry), when the checkpoint is not "
                        "here; the trained model's own maps are then not re-routed")
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
_SCALE_ONLY = ("--routing", "--checkpoint", "--markdown", "--counted-json", "--profile-json")


def _scale_flag_problem(args):
    """A scale-mode flag in counted mode, or a checkpoint the scale mode cannot use."""
    given = [f for f in _SCALE_ONLY if getattr(args, f[2:].replace("-", "_")) is not None]
    if not args.scale:
        return (f"{given[0]}: a --scale flag, unused in counted mode. Fix: add --scale or "
                f"drop {given[0]}") if given else None
    routing = args.routing or ["skewed"]
    if "checkpoint" in routing and not (args.checkpoint or args.profile_json):
        return ("--routing checkpoint needs --checkpoint DIR (e.g. runs/main_job/checkpoints "
                "from `make run`) or --profile-json FILE (an earlier --scale --json output)")
    if args.checkpoint and args.profile_json:
        return ("--profile-json: a second source of the load profile. Fix: pass --checkpoint "
                "or --profile-json, not both")
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


def _progress(message: str) -> None:
    print(f"[a2a_volume] {message}", file=sys.stderr, flush=True)


# ---- counted mode ----------------------------------------------------------------------------
def _summary(payload) -> str:
    lines = []
    for e in payload["results"]:
        head = f"EP={e['ep']} {e['dispatcher']:9s} {e['semantics']:4s} {e['variant']:13s}"
        if "error" in e:
            lines.append(f"{head} refused: {e['error'][:100]}")
            continue
        bad = [c for c in e["checks"] if not c["ok"]]
        views = f"  views pairs {e['views_pairs']}" if e.get("views_pairs") else ""
        lines.append(f"{head} analytic dispatch/rank {e['analytic_tokens_in']:>7d} B  "
                     f"checks {e['checks_exact']}/{e['checks_total']} exact{views}")
        for c in bad:
            lines.append(f"    MISMATCH {c['layer']} {c['what']}: counted {c['counted']} "
                         f"analytic {c['analytic']}")
    ratios = ", ".join(f"{k}={v:.3f}" for k, v in payload["ratios"].items())
    lines.append("ratio to latent baseline (forward dispatch token rows): " + (ratios or (
        "none: a ratio needs the latent baseline measured with the alltoall dispatcher at the "
        "same EP and semantics (add latent to --variants and alltoall to --dispatchers)")))
    if payload.get("ratios_with_bookkeeping"):
        lines.append("ratio to latent baseline (everything the forward dispatch sends: rows, "
                     "probs, weights and int64 bookkeeping): " + ", ".join(
                         f"{k}={v:.3f}" for k, v in payload["ratios_with_bookkeeping"].items()))
    return "\n".join(lines)


def _counted_config(args):
    from megatron_mvmoe.analysis.a2a.counted import CountedConfig

    return CountedConfig(ep=tuple(args.ep), variants=tuple(args.variants),
                         dispatchers=tuple(args.dispatchers), semantics=tuple(args.semantics),
                         gpus_per_node=args.gpus_per_node, batch_size=args.batch_size,
                         seq_length=args.seq_length, brief=args.brief,
                         num_experts=args.num_experts, topk=args.topk,
                         num_views=args.num_views, latent_size=args.latent_size)


def main_counted(args) -> int:
    from megatron_mvmoe.analysis.a2a.counted import counted_plot, measure_counted

    start = time.time()
    cfg = _counted_config(args)
    payload = measure_counted(cfg, timeout_s=args.timeout)
    payload.update(wall_s=round(time.time() - start, 1),
                   command=" ".join(["python", "tools/a2a_volume.py", *sys.argv[1:]]))
    if args.plot:
        payload["plot"] = counted_plot(payload["results"], args.plot, cfg)
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
            shares, payload["checkpoint"] = (_checkpoint_profile(args) if args.checkpoint
                                             else _recorded_profile(args.profile_json))
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


def _recorded_profile(path: str):
    """The load profile and checkpoint description an earlier --scale --json recorded."""
    import json

    try:
        with open(path) as f:
            recorded = json.load(f)["checkpoint"]
        shares = recorded["load_profile"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--profile-json {path}: no recorded load profile ({err}). Fix: pass "
                         "a --scale --json output of a --routing checkpoint run, e.g. "
                         "examples/results/a2a_at_scale.json") from None
    info = {k: v for k, v in recorded.items() if k != "tiny_real_routing"}
    info["profile_json"] = path
    return shares, info


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _scale_flag_problem(args) or (None if args.scale else counted_problem(
        _counted_config(args)))
    if problem:  # one line, before any rank is spawned
        return _fail(problem)
    args.routing = args.routing or ["skewed"]
    try:
        return main_scale(args) if args.scale else main_counted(args)
    except ValueError as err:
        return _fail(str(err))


if __name__ == "__main__":
    sys.exit(main())
