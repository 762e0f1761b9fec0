#!/usr/bin/env python
"""FLOPs and parameter parity of the seed-2 family (MH-MoE paper, Eq. 6-9).

Examples:
  python tools/parity.py                       # table of every paper-size preset
  python tools/parity.py --size tiny --json    # tiny CPU presets, machine-readable
  python tools/parity.py --config --heads 3    # derive the matched MH-MoE for H=3
  python tools/parity.py --config --heads 4 --hidden 768 --experts 8 --ffn 2048 --topk 1

Conventions are in megatron_mvmoe/functional/parity.py: SwiGLU experts count 3 matrices
(--expert-matrices 2 gives the summary's two-matrix count); leading term = 2 FLOPs per
multiply-accumulate without gating; exact = every scalar op including the gating network.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_mvmoe.config.seed2_presets import SIZES, all_presets, get_preset
from megatron_mvmoe.functional.parity import (
    FLOPS_TOLERANCE,
    PARAMS_TOLERANCE,
    MoELayerShape,
    derive_mh_moe,
    exact_flops_per_token,
    layer_params,
    leading_flops_per_token,
)
from megatron_mvmoe.functional.parity_model import parity_row

COLUMNS = [
    ("name", "preset", "{:<24}"), ("experts", "E", "{:>3}"), ("expert_ffn", "F", "{:>5}"),
    ("topk", "k", "{:>2}"), ("heads", "H", "{:>2}"),
    ("layer_params_total", "layer tot", "{:>11,}"), ("layer_params_active", "layer act", "{:>10,}"),
    ("model_params_total", "model tot", "{:>12,}"), ("model_params_active", "model act", "{:>12,}"),
    ("layer_flops_leading", "FLOPs lead", "{:>11,}"), ("layer_flops_exact", "FLOPs exact", "{:>11,}"),
    ("layer_gating_share", "gate%", "{:>6.2%}"), ("dev_layer_flops_pct", "dFLOP%", "{:>7.2f}"),
    ("dev_layer_params_pct", "dPar%", "{:>6.2f}"), ("dev_model_params_pct", "dModel%", "{:>7.2f}"),
    ("matched", "match", "{!s:>5}"), ("within_tolerance", "ok", "{!s:>5}"),
]


def preset_rows(size: str) -> list[dict]:
    rows = []
    for preset in all_presets(size):
        reference = get_preset(preset.reference, size).model if preset.reference else None
        row = parity_row(preset.name, preset.model, reference, preset.matched)
        row["paper_row"] = preset.paper_row
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = " ".join(f"{title:>{_width(fmt)}}" for _, title, fmt in COLUMNS)
    lines = [header]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            cells.append(fmt.format(value) if value is not None else f"{'-':>{_width(fmt)}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _width(fmt: str) -> int:
    digits = "".join(ch for ch in fmt.split(":")[1].split(".")[0].split(",")[0] if ch.isdigit())
    return int(digits)


def derive_report(args) -> dict:
    base = MoELayerShape(hidden_size=args.hidden, num_experts=args.experts,
                         expert_ffn=args.ffn, topk=args.topk,
                         shared_expert_ffn=args.shared_ffn,
                         expert_matrices=args.expert_matrices)
    derived = derive_mh_moe(base, args.heads, topk=args.mh_topk,
                            expert_multiple=args.expert_multiple,
                            head_projection=not args.no_head, merge_projection=not args.no_merge)
    shape = derived.shape
    out = {"base": _layer_summary(base), "derived": _layer_summary(shape),
           "exact_ffn": derived.exact_ffn, "exact_experts": derived.exact_experts,
           "flops_deviation_pct": 100 * derived.flops_deviation,
           "params_deviation_pct": 100 * derived.params_deviation,
           "within_tolerance": abs(derived.flops_deviation) <= FLOPS_TOLERANCE
           and abs(derived.params_deviation) <= PARAMS_TOLERANCE,
           "tolerance_pct": {"flops": 100 * FLOPS_TOLERANCE, "params": 100 * PARAMS_TOLERANCE}}
    return out


def _layer_summary(shape: MoELayerShape) -> dict:
    params = layer_params(shape)
    exact = exact_flops_per_token(shape)
    return {"hidden": shape.hidden_size, "heads": shape.routed_rows,
            "experts": shape.num_experts, "expert_ffn": shape.expert_ffn, "topk": shape.topk,
            "params_total": params.total, "params_active": params.active,
            "params_eq9": params.paper_total, "flops_leading": leading_flops_per_token(shape),
            "flops_exact": exact.total, "gating_flops": exact.gating,
            "gating_share": exact.gating_share}


def format_derived(report: dict) -> str:
    b, d = report["base"], report["derived"]
    return "\n".join([
        f"baseline : D={b['hidden']} E={b['experts']} F={b['expert_ffn']} top-{b['topk']}",
        f"derived  : H={d['heads']} E={d['experts']} F={d['expert_ffn']} top-{d['topk']} "
        f"(Eq. 8 F={report['exact_ffn']:.2f}, Eq. 9 E={report['exact_experts']:.2f})",
        f"leading FLOPs/token: {b['flops_leading']:,} -> {d['flops_leading']:,} "
        f"({report['flops_deviation_pct']:+.3f} %)",
        f"Eq. 9 params       : {b['params_eq9']:,} -> {d['params_eq9']:,} "
        f"({report['params_deviation_pct']:+.3f} %)",
        f"exact FLOPs/token  : {b['flops_exact']:,} -> {d['flops_exact']:,}; gating "
        f"{b['gating_share']:.2%} -> {d['gating_share']:.2%}",
        f"within tolerance ({report['tolerance_pct']['flops']:.0f} % FLOPs, "
        f"{report['tolerance_pct']['params']:.0f} % params): {report['within_tolerance']}",
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--size", choices=sorted(SIZES), default="paper", help="preset size")
    p.add_argument("--config", action="store_true",
                   help="derive the matched MH-MoE for --heads from the baseline flags")
    p.add_argument("--heads", type=int, default=2, help="H for --config")
    p.add_argument("--mh-topk", type=int, default=None, help="MH-MoE top-k (default H x --topk)")
    p.add_argument("--hidden", type=int, default=768, help="baseline D")
    p.add_argument("--experts", type=int, default=8, help="baseline E")
    p.add_argument("--ffn", type=int, default=2048, help="baseline expert ffn F")
    p.add_argument("--topk", type=int, default=1, help="baseline top-k")
    p.add_argument("--shared-ffn", type=int, default=0, help="shared expert ffn (0 = none)")
    p.add_argument("--expert-matrices", type=int, default=3, choices=(2, 3),
                   help="3 = SwiGLU (paper's models), 2 = the summary's two-matrix count")
    p.add_argument("--expert-multiple", type=int, default=8,
                   help="round E to this multiple (8 reproduces the paper's 40 and 96)")
    p.add_argument("--no-head", action="store_true", help="derive without a head projection")
    p.add_argument("--no-merge", action="store_true", help="derive without a merge projection")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.config:
            report = derive_report(args)
            print(json.dumps(report, indent=2) if args.json else format_derived(report))
        else:
            rows = preset_rows(args.size)
            print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
