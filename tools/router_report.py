#!/usr/bin/env python
"""Router diversity and expert load per MoE layer, from a checkpoint or a fresh model:
inter-head rank correlation and top-k overlap (vs chance k/E), mixing-weight entropy,
tokens per expert, load max/mean and coefficient of variation per layer and per EP rank.

Examples:
  python tools/router_report.py --model tiny_multi_view
  python tools/router_report.py --model runs/mv/ckpt --data-path data/tok --ep-size 2 --json
"""

from __future__ import annotations

import argparse
import sys

from megatron_mvmoe.toolkit import flags, output, specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True,
                   help="[label=]preset | run.yaml | checkpoint dir (repeatable)")
    p.add_argument("--ep-size", type=int, default=1,
                   help="EP size whose per-rank load to report (contiguous expert blocks)")
    flags.add_heldout_args(p)
    return p.parse_args(argv)


def _rank(rank, world_size, spec, args):
    import torch

    from megatron_mvmoe.analysis.routing import probe as moe_probe
    from megatron_mvmoe.analysis.routing.expert_load import load_report
    from megatron_mvmoe.functional.diversity import diversity_report
    from megatron_mvmoe.toolkit import heldout

    opened = specs.open_for_rank(spec, args)
    layers = moe_probe.moe_layers(opened.model)
    by_domain = heldout.heldout_batches(opened.run, args.batches, args.batch_size,
                                        args.seed)
    probes = moe_probe.probe_batches(opened.model, layers, by_domain,
                                     heldout.gpt_token_nll)
    diversity, maps = {}, {}
    for key, chunks in probes.items():
        mix = None if chunks[0].mix_TSR is None else torch.cat([c.mix_TSR for c in chunks])
        diversity[key] = diversity_report(torch.cat([c.scores_TRE for c in chunks]),
                                          torch.cat([c.topk_idx_TS for c in chunks]),
                                          mix).as_dict()
        maps[key] = torch.cat([c.routing_map_TE for c in chunks])
    return {"label": spec.label, "source": opened.source,
            "variant": opened.config.moe_variant,
            "data": heldout.SYNTHETIC if "random" in by_domain else sorted(by_domain),
            "diversity": diversity,
            "load": [entry.as_dict() for entry in load_report(maps, args.ep_size)]}


def _summary(results) -> str:
    lines = []
    for res in results:
        lines.append(f"{res['label']} ({res['variant']}, data {res['data']}, {res['source']})")
        loads = {str(entry["layer"]): entry for entry in res["load"]}
        for layer, div in res["diversity"].items():
            load = loads[str(layer)]
            corr = ", ".join(f"{k} {v:+.3f}" for k, v in div["rank_correlation"].items()) or "-"
            over = ", ".join(f"{k} {v:.3f}" for k, v in div["topk_overlap"].items()) or "-"
            ent = "-" if div["mixing_entropy"] is None else f"{div['mixing_entropy']:.3f}"
            lines.append(
                f"  layer {layer}: head rho {corr}; top-k overlap {over} (chance "
                f"{div['chance_overlap']:.3f}); mix entropy {ent}; load max/mean "
                f"{load['experts']['max_over_mean']:.3f} CV {load['experts']['cv']:.3f}; "
                f"EP-rank max/mean {load['ranks']['max_over_mean']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results, payload = specs.run_per_model("tools/router_report.py", args, _rank)
    if results is None:
        return output.fail(payload["error"])[0]
    output.emit(payload, args.json, _summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
