"""The MoE-layer cost as the work grows: sweep points, the results page and its plots.

`tools/bench_moe_layer.py --sweep` varies one field at a time (tokens per rank, experts,
top-k, hidden size), the others at the preset's values; with the hidden size the latent,
expert and shared-expert widths scale by the preset's ratios (10B-A1B: L = D/8,
F = 1.9375 D, S = D/2). Every point is one interleaved run of latent, Multi-Router and
Multi-View (analysis/layer_bench.py), so each ratio comes with the spread of its per-round
ratios. The page (`write`) holds the tables, the command and the two plots:
Multi-View/latent time ratio against its analytic FLOP ratio, and achieved GFLOP/s against
the measured matmul peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

AXES: Dict[str, List[int]] = {
    "tokens": [256, 1024, 4096, 8192],
    "num_experts": [16, 32, 64, 128],
    "moe_router_topk": [2, 4, 8],
    "hidden_size": [512, 1024, 2048],
}
"""Swept field -> values (tokens per rank; the others are LayerShape fields)."""


def scaled_shape(base, field: str, value: int):
    """`base` with `field` = value; a hidden-size change scales the D-derived widths."""
    if field == "tokens":
        return base
    if field != "hidden_size":
        return dataclasses.replace(base, **{field: value})
    ratio = value / base.hidden_size
    shared = base.moe_shared_expert_intermediate_size
    return dataclasses.replace(
        base, hidden_size=value, latent_size=max(1, round(base.latent_size * ratio)),
        moe_ffn_hidden_size=max(1, round(base.moe_ffn_hidden_size * ratio)),
        moe_shared_expert_intermediate_size=round(shared * ratio) if shared else shared)


def sweep_points(base, base_tokens: int, tokens_axis: Optional[List[int]] = None
                 ) -> List[Tuple[str, int, object, int]]:
    """(field, value, shape, tokens) for every point of every axis (`tokens_axis` replaces
    AXES' tokens values)."""
    points = []
    axes = dict(AXES, tokens=tokens_axis) if tokens_axis else AXES
    for field, values in axes.items():
        for value in values:
            if field != "tokens" and value > (base.num_experts if field == "moe_router_topk"
                                              else 1 << 30):
                continue
            tokens = value if field == "tokens" else base_tokens
            points.append((field, value, scaled_shape(base, field, value), tokens))
    return points


def point_gib(shape) -> float:
    """Rough resident GiB of one point: three layers' weights and gradients in fp32 (the
    experts, shared expert, down/up projections, two router heads)."""
    D, L, E, F = (shape.hidden_size, shape.latent_size, shape.num_experts,
                  shape.moe_ffn_hidden_size)
    params = E * 3 * L * F + 3 * D * (shape.moe_shared_expert_intermediate_size or 0)
    params += 2 * D * L + 2 * D * E
    return 3 * 2 * 4 * params / 2 ** 30


def point_cost(shape, tokens: int) -> float:
    """Relative work of a point (tokens x top-k x D^2), to measure the cheap ones first."""
    return tokens * shape.moe_router_topk * shape.hidden_size ** 2


def run_sweep(args, base, pgs, run_point: Callable, fast_path: Dict,
              on_point: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Every sweep point measured (a point shared by two axes is measured once), cheapest
    first; `on_point` gets the output so far after every point (a cut-short sweep keeps
    what it measured)."""
    points = sweep_points(base, args.sweep_base_tokens, getattr(args, "sweep_tokens", None))
    order = {(field, value): i for i, (field, value, _, _) in enumerate(points)}
    done: Dict[Tuple, Dict] = {}
    out = {"preset": args.preset, "base_shape": dataclasses.asdict(base),
           "base_tokens": args.sweep_base_tokens, "repeats": args.repeats,
           "warmup": args.warmup, "dtype": args.dtype, "cpu_grouped_experts": fast_path,
           "clock": args.clock, "threads": _threads(), "rows": []}
    max_gib = getattr(args, "sweep_max_gib", None)
    out["skipped"] = []
    for field, value, shape, tokens in sorted(points, key=lambda p: point_cost(p[2], p[3])):
        if max_gib is not None and point_gib(shape) > max_gib:
            out["skipped"].append({"axis": field, "value": value, "gib": point_gib(shape)})
            continue
        key = (dataclasses.astuple(shape), tokens)
        if key not in done:
            start = time.perf_counter()
            done[key] = run_point(args, shape, tokens, pgs, "built")
            done[key]["wall_s"] = time.perf_counter() - start
        out["rows"].append({"axis": field, "value": value, **_row(done[key])})
        out["rows"].sort(key=lambda r: order[(r["axis"], r["value"])])
        if on_point is not None:
            on_point(out)
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _row(point: Dict) -> Dict:
    """One sweep row: per variant the spreads of the impl that was built (`pairs`), its
    memory and experts class (`variants`)."""
    def variant_row(v: str, r: Dict) -> Dict:
        pair = point["pairs"][f"{v}/{point['impl']}"]
        return {"seconds": pair["seconds"], "gflops": pair["gflops"],
                "peak_fraction": pair["peak_fraction"], "time_ratio": pair["time_ratio"],
                "flop_ratio": pair["flop_ratio"], "memory_bytes": r["memory_bytes"],
                "memory_ratio": r["memory_ratio"], "experts": r["experts"]}

    return {"tokens": point["tokens"], "shape": point["shape"], "impl": point["impl"],
            "wall_s": point.get("wall_s"), "peak_gflops": point["peak_gflops"],
            "variants": {v: variant_row(v, r) for v, r in point["variants"].items()}}


def _fmt_spread(s: Dict[str, float], digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def text(out: Dict) -> str:
    """The sweep as one Markdown table per axis."""
    lines = []
    for axis in AXES:
        rows = [r for r in out["rows"] if r["axis"] == axis]
        if not rows:
            continue
        lines += [f"### {axis}", "",
                  f"| {axis} | tokens | experts | latent s | latent GFLOP/s (% peak) | "
                  "MR/latent time | MR FLOP x | MV/latent time | MV FLOP x | MV/FLOP | MV mem x | "
                  "peak GFLOP/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            v = r["variants"]
            lat, mr, mv = v["latent"], v["multi_router"], v["multi_view"]
            lines.append(
                f"| {r['value']} | {r['tokens']} | {lat['experts']} | "
                f"{_fmt_spread(lat['seconds'])} | "
                f"{lat['gflops']['median']:.1f} ({100 * lat['peak_fraction']['median']:.0f}%) | "
                f"{_fmt_spread(mr['time_ratio'])} | {mr['flop_ratio']:.3f} | "
                f"{_fmt_spread(mv['time_ratio'])} | {mv['flop_ratio']:.3f} | "
                f"{mv['time_ratio']['median'] / mv['flop_ratio']:.3f} | "
                f"{mv['memory_ratio']:.3f} | "
                + "/".join(f"{p:.0f}" for p in r["peak_gflops"]) + " |")
        lines.append("")
    return "\n".join(lines)


def page(out: Dict, stem: str) -> str:
    """The results page: how it was measured, the command, one table per axis, the plots."""
    name = os.path.basename(stem)
    measured = sorted({(r["axis"], r["value"]) for r in out["rows"]})
    return "\n".join([
        "# One MoE layer as the work grows (issue 21 item 3)", "",
        f"Preset {out.get('preset')} (base shape {out.get('base_shape')}), one field swept "
        f"at a time, {out.get('base_tokens')} tokens per rank while another is swept; "
        f"{out.get('dtype')}, clock `{out.get('clock')}` with {out.get('threads')} thread(s), "
        f"{out.get('repeats')} timed rounds after the memory pass (the warm-up), every round "
        "running latent, Multi-Router and Multi-View in turn. Each cell is the median "
        "[min, max] of per-round values; ratios are per round against latent. Experts: "
        "whatever the fast-path rule builds (cpu_grouped_experts: "
        f"{out.get('cpu_grouped_experts', {}).get('why', '?')}).", "",
        f"Points measured: {len(measured)}. Skipped (weights + grads of the three layers "
        f"above --sweep-max-gib): "
        + (", ".join(f"{s['axis']}={s['value']} ({s['gib']:.1f} GiB)"
                     for s in out.get("skipped", [])) or "none") + ".", "",
        "```", out.get("command", "python tools/bench_moe_layer.py --sweep ..."), "```", "",
        text(out), "",
        f"![Multi-View / latent time vs FLOP ratio]({name}_mv_ratio.png)", "",
        f"![achieved GFLOP/s vs measured peak]({name}_gflops.png)", ""])


def write(out: Dict, json_path: str) -> List[str]:
    """JSON at `json_path`, the page and the two plots beside it; returns the paths."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(out, fh, indent=1)
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as fh:
        fh.write(page(out, stem))
    return [json_path, stem + ".md", plot_ratio(out, stem + "_mv_ratio.png"),
            plot_throughput(out, stem + "_gflops.png")]


def _series(out: Dict, axis: str):
    rows = [r for r in out["rows"] if r["axis"] == axis]
    return [r["value"] for r in rows], rows


def _errorbar(ax, xs, spreads, **style) -> None:
    """Medians with min-max bars."""
    med = [s["median"] for s in spreads]
    ax.errorbar(xs, med, yerr=[[m - s["min"] for m, s in zip(med, spreads)],
                               [s["max"] - m for m, s in zip(med, spreads)]],
                marker="o", capsize=3, **style)


def plot_ratio(out: Dict, path: str) -> str:
    """Per axis: MV/latent time ratio (median, min-max bars) and its analytic FLOP ratio."""
    from megatron_mvmoe.analysis.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(AXES), figsize=(12, 3.2), sharey=True)
    for ax, axis in zip(axes, AXES):
        xs, rows = _series(out, axis)
        _errorbar(ax, xs, [r["variants"]["multi_view"]["time_ratio"] for r in rows],
                  label="MV/latent time (per-round min-max)")
        flop = [r["variants"]["multi_view"]["flop_ratio"] for r in rows]
        ax.plot(xs, flop, "k--", label="analytic FLOP ratio")
        ax.plot(xs, [1.1 * f for f in flop], ":", color="grey", label="1.1 x FLOP ratio")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
    axes[0].set_ylabel("Multi-View / latent")
    axes[0].legend(fontsize=7)
    fig.suptitle("Multi-View / latent time vs analytic FLOP ratio (one MoE layer, fwd+bwd)")
    return _save(plt, fig, path)


def plot_throughput(out: Dict, path: str) -> str:
    """Per axis: achieved GFLOP/s of each variant (min-max bars) and the measured peak."""
    from megatron_mvmoe.analysis.plots import _pyplot, _save, curve_style

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(AXES), figsize=(12, 3.2), sharey=True)
    for ax, axis in zip(axes, AXES):
        xs, rows = _series(out, axis)
        for index, variant in enumerate(("latent", "multi_router", "multi_view")):
            color, style = curve_style(index)
            _errorbar(ax, xs, [r["variants"][variant]["gflops"] for r in rows],
                      color=color, linestyle=style, label=variant)
        ax.plot(xs, [max(r["peak_gflops"]) for r in rows], "k--", label="measured matmul peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
    axes[0].set_ylabel("GFLOP/s (fp32)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Achieved GFLOP/s of one MoE layer vs the measured matmul peak")
    return _save(plt, fig, path)
