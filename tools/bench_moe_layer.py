"""Benchmark one MoE layer: latent baseline vs Multi-Router vs Multi-View, side by side.

    python tools/bench_moe_layer.py                          # 10B-A1B layer, 512 tokens
    python tools/bench_moe_layer.py --preset mvmoe_10b_a1b --tokens 4096 --json
    python tools/bench_moe_layer.py --hidden 1024 --latent 512 --experts 64 --expert-ffn 512
    python tools/bench_moe_layer.py --sweep --out examples/results/scaling.json   # item 3
    python tools/bench_moe_layer.py --preset mvmoe_10b_a1b --dtype bf16 --tokens 16384  # GPU
    python tools/bench_moe_layer.py --tokens 4096 --clock cpu --threads 1   # a shared machine

Single process (gloo world of 1, or NCCL on a GPU). The layers are the trainer's: the
preset's model section with the given fields overridden, `provider.transformer_config`
(SwiGLU, shared expert, sigmoid routing, this machine's fast paths) and the decoder block's
MoE builder (megatron_mvmoe/analysis/layer_bench.py). On CPU, `--experts-impl both` (the
default) builds the experts as GroupedMatmulExperts whatever the fast-path rule
`cpu_grouped_experts` picks and times each variant both ways on the same weights: grouped
(torch._grouped_mm) and SequentialMLP.forward; `built` times only what the rule builds.
Every timed round runs each (variant, impl) once in turn; ratios are per round (median,
min, max). Achieved GFLOP/s is 3 x analytic forward FLOPs x tokens / time, next to the
matmul peak measured with the same clock before every round (layer_bench.matmul_peak).
--clock cpu times the process's CPU time (use it with --threads 1 when other jobs share
the cores: the wall clock then measures the scheduler's share, not the work).
Memory: on CPU the bytes autograd saves for backward; on CUDA the allocator peak; that
pass runs first and warms every layer up.

--sweep varies one field at a time over tokens per rank, experts, top-k and hidden size,
the others at the preset's values (D-derived widths keep the 10B-A1B ratios), and writes
--out (JSON) plus the results page and plots next to it (analysis/scaling_report.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Dict, List

import torch

warnings.filterwarnings("ignore")

from megatron_mvmoe.analysis import layer_bench as lb

_SHAPE_FLAGS = {"hidden": "hidden_size", "latent": "latent_size", "experts": "num_experts",
                "topk": "moe_router_topk", "expert_ffn": "moe_ffn_hidden_size",
                "shared_ffn": "moe_shared_expert_intermediate_size",
                "routers": "num_routers"}
"""--flag -> LayerShape field."""


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mvmoe_10b_a1b",
                   help="model preset the layers come from (its D, L, E, k, F, S, R)")
    p.add_argument("--hidden", type=int, help="D: model hidden size (default: preset's)")
    p.add_argument("--latent", type=int, help="L: latent size")
    p.add_argument("--experts", type=int, help="E: routed experts")
    p.add_argument("--topk", type=int, help="k: experts per token")
    p.add_argument("--routers", type=int, help="R = K: routing heads / views")
    p.add_argument("--expert-ffn", type=int, help="F: expert FFN hidden size")
    p.add_argument("--shared-ffn", type=int, help="S: shared-expert width (0: none)")
    p.add_argument("--tokens", type=int, default=512, help="T: tokens per forward")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--experts-impl", choices=["both", "built"], default="both",
                   help="both: time grouped experts and SequentialMLP on the same weights "
                        "(CPU); built: only what the fast paths built")
    p.add_argument("--clock", choices=sorted(lb.CLOCKS), default="wall",
                   help="wall: perf_counter; cpu: this process's CPU time")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed rounds after the (untimed) memory pass")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--tolerance", type=float, default=1.1,
                   help="pass if MV time ratio <= tolerance x analytic FLOP ratio")
    p.add_argument("--sweep", action="store_true", help="the scaling sweep (see above)")
    p.add_argument("--sweep-base-tokens", type=int, default=1024,
                   help="tokens per rank while another field is swept")
    p.add_argument("--sweep-max-gib", type=float,
                   help="skip sweep points whose three layers' weights + grads exceed this "
                        "(listed in the output), e.g. 3 to run without the big-memory lock")
    p.add_argument("--sweep-tokens", type=int, nargs="+",
                   help="the tokens axis of the sweep (default: 256 1024 4096 8192)")
    p.add_argument("--out", default=None, help="--sweep: JSON path (page and plots beside)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    from megatron_mvmoe.config.presets import PRESETS

    if args.preset not in PRESETS:
        p.error(f"--preset {args.preset!r}: not a preset (choose from {sorted(PRESETS)})")
    for name in ("tokens", "repeats", "sweep_base_tokens", "threads", *_SHAPE_FLAGS):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "shared_ffn" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.sweep_tokens and min(args.sweep_tokens) < 1:
        p.error(f"--sweep-tokens must all be >= 1, got {args.sweep_tokens}")
    if args.sweep and not args.out:
        p.error("--sweep needs --out PATH.json (e.g. examples/results/scaling.json)")
    return args


def base_shape(args) -> lb.LayerShape:
    """The preset's layer with the explicit flags applied."""
    from megatron_mvmoe.config.model_section import model_from_preset

    shape = lb.LayerShape.of(model_from_preset(args.preset))
    given = {field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items()
             if getattr(args, flag) is not None}
    if given.get("moe_shared_expert_intermediate_size") == 0:
        given["moe_shared_expert_intermediate_size"] = None
    shape = lb.dataclasses.replace(shape, **given)
    if shape.moe_router_topk > shape.num_experts:
        raise SystemExit(f"--topk {shape.moe_router_topk} exceeds --experts "
                         f"{shape.num_experts}. Fix: choose a top-k <= the expert count")
    return shape


def impls_for(layers) -> List[str]:
    built = {lb.experts_class(layer) for layer in layers.values()}
    return list(lb.IMPLS) if built == {"GroupedMatmulExperts"} else ["built"]


def planned_activation_bytes(args, shape: lb.LayerShape, variant: str, tokens: int,
                             layer) -> float:
    """What the planner (planning/memory.py moe_layer_elements) counts as saved for backward
    by this layer, activations only: memory_bytes also counts the weights autograd saves
    (CPU) or the allocator's whole peak, weights and gradients included (CUDA)."""
    from megatron_mvmoe.planning.memory import moe_layer_elements

    section = lb.variant_section(args.preset, shape, variant)
    grouped = lb.experts_class(layer) == "GroupedMatmulExperts"
    return moe_layer_elements(section, tokens, 1, grouped) * (2 if args.dtype == "bf16" else 4)


def run_point(args, shape: lb.LayerShape, tokens: int, pgs, impls_wanted: str) -> Dict:
    """Build, time (interleaved) and summarize one layer shape."""
    from megatron_mvmoe import platform

    platform.seed_all(0)
    both = impls_wanted == "both" and not platform.is_cuda()
    layers = lb.build_layers(args.preset, shape, pgs, use_bf16=args.dtype == "bf16",
                             grouped=True if both else None)
    impls = impls_for(layers)
    if not both:
        impls = ["grouped" if impls == list(lb.IMPLS) else "built"]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(tokens, 1, shape.hidden_size, dtype=dtype, device=platform.device())
    memory = {v: lb.memory_bytes(layer, x) for v, layer in layers.items()}  # + warm-up
    peaks: List[float] = []
    times = lb.timed_rounds(layers, x, impls, args.warmup, args.repeats, args.clock, peaks)
    flops = {v: lb.layer_flops_per_token(lb.variant_section(args.preset, shape, v))
             for v in layers}
    rows = lb.summarize(times, flops, tokens, max(peaks))
    main_impl = impls[-1]
    variants = {}
    for v, layer in layers.items():
        row = rows[f"{v}/{main_impl}"]
        variants[v] = dict(row, median_s=row["seconds"]["median"],
                           time_ratio=row["time_ratio"]["median"],
                           achieved_tflops=row["gflops"]["median"] / 1e3,
                           memory_bytes=memory[v],
                           planned_bytes=planned_activation_bytes(args, shape, v, tokens, layer),
                           flops_per_token=flops[v], experts=lb.experts_class(layer))
    base_mem = variants["latent"]["memory_bytes"]
    for row in variants.values():
        row["memory_ratio"] = row["memory_bytes"] / base_mem
    mv = variants["multi_view"]
    del layers
    return {"shape": lb.dataclasses.asdict(shape), "tokens": tokens, "impl": main_impl,
            "clock": args.clock, "threads": torch.get_num_threads(),
            "cpu_grouped_experts_rule": fast_path_line(shape),
            "peak_gflops": [p / 1e9 for p in peaks], "variants": variants, "pairs": rows,
            "mv_time_within_tolerance": mv["time_ratio"] <= args.tolerance * mv["flop_ratio"]}


def fast_path_line(shape: lb.LayerShape) -> Dict:
    """The fast-path rule's cpu_grouped_experts decision for the layer at `shape`."""
    from megatron_mvmoe.models.fast_paths import (GROUPED_MM_MAX_EXPERT_ELEMENTS, Target,
                                                  choose_fast_paths)

    elements = shape.latent_size * shape.moe_ffn_hidden_size  # the latent variants' experts
    path = next(p for p in choose_fast_paths(Target.here(), "multi_view",
                                             expert_elements=elements)
                if p.name == "cpu_grouped_experts")
    return {"on": path.on, "why": path.why, "expert_elements": elements,
            "threshold": GROUPED_MM_MAX_EXPERT_ELEMENTS}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads or os.cpu_count() or 1))
    if args.threads:
        torch.set_num_threads(args.threads)
    from megatron_mvmoe.toolkit.output import emit

    shape = base_shape(args)
    with lb.single_rank_layout() as pgs:
        if args.sweep:
            from megatron_mvmoe.analysis import scaling_report

            out_command = "python tools/bench_moe_layer.py " + " ".join(argv)
            out = scaling_report.run_sweep(args, shape, pgs, run_point, fast_path_line(shape),
                                           lambda part: scaling_report.write(
                                               dict(part, command=out_command), args.out))
            scaling_report.write(dict(out, command=out_command), args.out)  # skips at the end
            emit(out, args.json, scaling_report.text(out))
            return 0
        out = run_point(args, shape, args.tokens, pgs, args.experts_impl)
    out.update(config=vars(args), cpu_grouped_experts=fast_path_line(shape),
               memory_kind="cuda_peak" if torch.cuda.is_available() else "saved_activations")
    emit(out, args.json, point_text(out, args.tolerance))
    return 0


def point_text(out: Dict, tolerance: float) -> str:
    fp = out["cpu_grouped_experts"]
    lines = [f"cpu_grouped_experts: {'on' if fp['on'] else 'off'} ({fp['why']})",
             f"matmul peak {max(out['peak_gflops']):.1f} GFLOP/s ({out['clock']} clock, "
             f"{out['threads']} threads; per round: "
             + ", ".join(f"{p:.1f}" for p in out["peak_gflops"]) + ")",
             f"{'variant/impl':26s} {'median_s':>9s} {'GFLOP/s [min,max]':>22s} "
             f"{'%peak':>6s} {'time_x [min,max]':>22s} {'flop_x':>7s} {'grouped_x':>10s}"]
    for key, r in out["pairs"].items():
        g, t = r["gflops"], r["time_ratio"]
        speed = r.get("speedup_vs_sequential", {}).get("median")
        lines.append(f"{key:26s} {r['seconds']['median']:9.3f} {g['median']:7.1f} "
                     f"[{g['min']:6.1f},{g['max']:6.1f}] {100 * r['peak_fraction']['median']:5.1f}"
                     f"% {t['median']:7.3f} [{t['min']:5.3f},{t['max']:5.3f}] "
                     f"{r['flop_ratio']:7.3f} {'' if speed is None else f'{speed:9.2f}x'}")
    for v, r in out["variants"].items():
        lines.append(f"memory {v:13s} {r['memory_bytes'] / 2 ** 20:9.1f} MB "
                     f"(x{r['memory_ratio']:.3f}, {out['memory_kind']})")
    lines.append(f"Multi-View time ratio <= {tolerance} x FLOP ratio: "
                 f"{out['mv_time_within_tolerance']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
