#!/usr/bin/env python
"""Routing score-utility alignment (seed 000, Figure 2 / Table 2) on CPU in minutes.

For each model: every expert of every MoE layer is evaluated densely on held-out tokens;
the per-token Spearman rho between the router's summed scores and each expert utility
(normalised output norm; optionally the loss change when an expert is forced in/out) is
averaged per layer and globally, with seeded bootstrap confidence intervals over tokens.

Examples:
  python tools/routing_alignment.py --model single=tiny_latent --model multi=tiny_multi_router
  python tools/routing_alignment.py --model runs/ckpt_latent --model runs/ckpt_mr \
      --loss-utility --plot examples/results/alignment.png --json
"""

from __future__ import annotations

import argparse
import sys

from megatron_mvmoe.toolkit import flags, output, specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True,
                   help="[label=]preset | run.yaml | checkpoint dir (repeatable)")
    flags.add_heldout_args(p)
    p.add_argument("--loss-utility", action="store_true",
                   help="also the loss-change utility (E extra forwards per layer and batch)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--plot", default=None, help="PNG path for the per-layer figure")
    return p.parse_args(argv)


def _analyse(rank, world_size, spec, args):
    from megatron_mvmoe.analysis.routing import alignment_run
    from megatron_mvmoe.toolkit import heldout

    opened = specs.open_for_rank(spec, args)
    by_domain = heldout.heldout_batches(opened.run, args.batches, args.batch_size,
                                        args.seed)
    batches = [b for domain in sorted(by_domain) for b in by_domain[domain]]
    say = (lambda m: print(f"[{spec.label}] {m}", file=sys.stderr, flush=True)) \
        if rank == 0 else None
    data = alignment_run.collect(opened.model, batches, heldout.gpt_token_nll,
                                 loss_utility=args.loss_utility, progress=say)
    if say is not None:
        say(f"bootstrap confidence intervals ({args.resamples} resamples)")
    reports = alignment_run.reports(data, args.resamples, args.level, args.seed)
    config = opened.config
    return {
        "label": spec.label, "source": opened.source,
        "variant": config.moe_variant, "num_routers": config.multi_view.num_routers,
        "num_experts": config.num_moe_experts, "topk": config.moe_router_topk,
        "data": sorted(by_domain) if "random" not in by_domain else heldout.SYNTHETIC,
        "tokens": int(sum(t.numel() for t in data.scores[min(data.scores)])
                      // config.num_moe_experts),
        "utilities": {name: report.as_dict() for name, report in reports.items()},
    }


def _summary(results) -> str:
    lines = []
    for res in results:
        lines.append(f"{res['label']} ({res['variant']}, R={res['num_routers']}, "
                     f"{res['tokens']} tokens, data={res['data']}, {res['source']})")
        for name, rep in res["utilities"].items():
            glob = rep["global"]
            lines.append(f"  utility={name}: global rho {glob['estimate']:+.4f} "
                         f"[{glob['low']:+.4f}, {glob['high']:+.4f}]")
            for layer in rep["layers"]:
                pt = layer["per_token"]
                lines.append(f"    layer {layer['layer']}: {pt['estimate']:+.4f} "
                             f"[{pt['low']:+.4f}, {pt['high']:+.4f}] pooled "
                             f"{layer['pooled']:+.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results, payload = specs.run_per_model("tools/routing_alignment.py", args, _analyse)
    if results is None:
        return output.fail(payload["error"])[0]
    if args.plot:
        from megatron_mvmoe.analysis.plots import plot_alignment

        for name in results[0]["utilities"]:
            path = args.plot if name == "norm" else args.plot.replace(".png", f"_{name}.png")
            plot_alignment({r["label"]: r["utilities"][name] for r in results}, path,
                           f"router score vs {name} utility")
            payload.setdefault("plots", []).append(path)
    output.emit(payload, args.json, _summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
