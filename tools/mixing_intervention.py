#!/usr/bin/env python
"""Controlled mixing interventions (seed 000): at one Multi-View layer, hold the selected
experts and output gates fixed and replace the view-mixing proportions (view-1 only, view-2
only, uniform, swapped; identity as the control); report ΔNLL per held-out domain and
verify that selection and gates stayed exactly fixed.

Examples:
  python tools/mixing_intervention.py --model tiny_multi_view
  python tools/mixing_intervention.py --model runs/mv/ckpt --data-path data/tok --layer 2 --json
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_mvmoe.analysis.routing.interventions import POLICIES
from megatron_mvmoe.toolkit import flags, output, specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="[label=]preset | run.yaml | checkpoint dir")
    p.add_argument("--layer", type=int, default=None,
                   help="MoE layer number (default: the last MoE layer, as the paper)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    flags.add_heldout_args(p)
    p.add_argument("--plot", default=None, help="PNG of ΔNLL per policy and domain")
    return p.parse_args(argv)


def _rank(rank, world_size, spec, args):
    from megatron_mvmoe.analysis.routing import probe as moe_probe
    from megatron_mvmoe.analysis.routing.interventions import run_interventions
    from megatron_mvmoe.toolkit import heldout

    opened = specs.open_for_rank(spec, args)
    layers = moe_probe.moe_layers(opened.model)
    number = max(layers) if args.layer is None else args.layer
    if number not in layers:
        raise ValueError(f"--layer {number}: not an MoE layer. Fix: use one of {sorted(layers)}")
    batches = heldout.heldout_batches(opened.run, args.batches, args.batch_size, args.seed)
    results = run_interventions(opened.model, layers[number], batches,
                                heldout.gpt_token_nll, args.policies)
    return {"label": spec.label, "source": opened.source, "layer": number,
            "gamma": float(layers[number].gamma()),
            "data": heldout.SYNTHETIC if "random" in batches else sorted(batches),
            "policies": [r.as_dict() for r in results]}


def _summary(res) -> str:
    lines = [f"{res['label']} layer {res['layer']} (gamma {res['gamma']:.3f}, data "
             f"{res['data']}, {res['source']})"]
    for pol in res["policies"]:
        deltas = ", ".join(f"{d['domain']} {d['delta_nll']:+.5f}" for d in pol["domains"])
        lines.append(f"  {pol['policy']:9s} ΔNLL {deltas}   selection fixed "
                     f"{pol['selection_fixed']}, max |Δgate| {pol['max_gate_diff']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spec = specs.parse_model_spec(args.model)
        unknown = [p for p in args.policies if p not in POLICIES and not p.startswith("view")]
        if unknown:
            raise ValueError(f"--policies: unknown {unknown}. Fix: use {list(POLICIES)}")
    except ValueError as err:
        return output.fail(str(err))[0]
    start = time.time()
    res = specs.single_rank(_rank, spec, args)
    res["wall_s"] = round(time.time() - start, 1)
    res["command"] = " ".join(["python", "tools/mixing_intervention.py", *sys.argv[1:]])
    fixed = all(p["selection_fixed"] and p["max_gate_diff"] == 0.0 for p in res["policies"])
    identity_zero = all(d["delta_nll"] == 0.0 for p in res["policies"]
                        if p["policy"] == "identity" for d in p["domains"])
    res.update(selection_and_gates_fixed=fixed, identity_delta_exactly_zero=identity_zero)
    if args.plot:
        from megatron_mvmoe.analysis.plots import plot_bars

        bars = {p["policy"]: {d["domain"]: d["delta_nll"] for d in p["domains"]}
                for p in res["policies"]}
        res["plot"] = plot_bars(bars, args.plot, f"mixing interventions, layer {res['layer']}",
                                "ΔNLL (nats/token)")
    output.emit(res, args.json, _summary(res))
    return 0 if fixed and identity_zero else 1


if __name__ == "__main__":
    sys.exit(main())
