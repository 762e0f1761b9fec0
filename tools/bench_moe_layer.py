"""Benchmark one MoE layer: latent baseline vs Multi-Router vs Multi-View, side by side.

    python tools/bench_moe_layer.py                       # D=1024, L=512, E=64, top-8, R=K=2
    python tools/bench_moe_layer.py --tokens 256 --repeats 3 --json
    python tools/bench_moe_layer.py --preset mvmoe_10b_a1b --dtype bf16 --tokens 16384  # GPU

Single process (gloo world of 1, or NCCL on a GPU). Each timed iteration runs forward +
backward of every variant in turn (round-robin, so machine noise hits all of them alike);
the median over --repeats after --warmup iterations is reported with the ratio to the
baseline, next to the analytic forward FLOP ratio, the check
`time_ratio(MV) <= 1.1 x flop_ratio(MV)` and the achieved TFLOP/s (3 x analytic forward
FLOPs per token x tokens / time). `--preset` takes D, L, E, k, R and F from a model preset
(one 10B-A1B layer at real size); the layer takes the fast paths of this machine
(models/fast_paths.py: TE grouped experts and fusions on a GPU with TE). Memory: on CUDA the allocator peak of one
forward+backward; on CPU (no allocator statistics) the bytes of activations saved for
backward, a deterministic proxy measured with autograd saved-tensor hooks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from typing import Dict, List

import torch

warnings.filterwarnings("ignore")
VARIANTS = ("latent", "multi_router", "multi_view")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None,
                   help="take --hidden/--latent/--experts/--topk/--routers/--expert-ffn from "
                        "this model preset (e.g. mvmoe_10b_a1b); explicit flags still win")
    p.add_argument("--hidden", type=int, default=1024, help="D: model hidden size")
    p.add_argument("--latent", type=int, default=512, help="L: latent size")
    p.add_argument("--experts", type=int, default=64, help="E: routed experts")
    p.add_argument("--topk", type=int, default=8, help="k: experts per token")
    p.add_argument("--routers", type=int, default=2, help="R = K: routing heads / views")
    p.add_argument("--expert-ffn", type=int, default=512, help="F: expert FFN hidden size")
    p.add_argument("--tokens", type=int, default=512, help="T: tokens per forward")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations")
    p.add_argument("--repeats", type=int, default=5, help="timed iterations (median)")
    p.add_argument("--tolerance", type=float, default=1.1,
                   help="pass if time ratio <= tolerance x analytic FLOP ratio")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.preset:
        _apply_preset(args, p, argv)
    for name in ("hidden", "latent", "experts", "topk", "routers", "expert_ffn", "tokens",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    return args


_PRESET_FIELDS = {"hidden": "hidden_size", "latent": "latent_size", "experts": "num_experts",
                  "topk": "moe_router_topk", "routers": "multi_view.num_routers",
                  "expert_ffn": "moe_ffn_hidden_size"}
"""--flag -> ModelSection field (dotted: a nested config's)."""


def _apply_preset(args, parser, argv: List[str]) -> None:
    from megatron_mvmoe.models.model_section import model_from_preset
    from megatron_mvmoe.models.presets import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r}: not a preset (choose from {sorted(PRESETS)})")
    shape = model_from_preset(args.preset)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    for name, field in _PRESET_FIELDS.items():
        value = functools.reduce(getattr, field.split("."), shape)
        if f"--{name.replace('_', '-')}" not in given and value:
            setattr(args, name, value)


def analytic_flops(args, variant: str) -> int:
    """Forward multiply-add FLOPs per token (backward is ~2x for every term alike)."""
    D, L, E, k, R, F = (args.hidden, args.latent, args.experts, args.topk, args.routers,
                        args.expert_ffn)
    heads = 1 if variant == "latent" else R
    flops = 2 * D * E * heads            # router GEMM(s)
    flops += 2 * D * L + 2 * L * D       # down and up projections
    flops += k * (2 * L * F + 2 * F * L)  # k experts in latent space
    if variant == "multi_view":
        flops += (R - 1) * 2 * D * L     # view perturbations dP_m h
        flops += k * R * L * 2           # per-(token, slot) blend of R views
    return flops


def make_config(args, variant: str):
    from megatron_mvmoe.config import MultiViewConfig, MVMoETransformerConfig
    from megatron_mvmoe.models.fast_paths import Target, choose_fast_paths, config_fields

    R = 1 if variant == "latent" else args.routers
    fast = config_fields(choose_fast_paths(Target.here(), variant))
    fast.pop("gradient_accumulation_fusion", None)  # needs DDP main_grad buffers
    return MVMoETransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
        ffn_hidden_size=4 * args.hidden, use_cpu_initialization=not torch.cuda.is_available(),
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        persist_layer_norm=False, **fast,
        bf16=args.dtype == "bf16", params_dtype=_dtype(args),
        num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.0,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_variant=variant, latent_size=args.latent,
        multi_view=MultiViewConfig(num_routers=R, num_views=R if variant == "multi_view" else 1))


def _dtype(args):
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def build_layers(args, pgs, device) -> Dict[str, torch.nn.Module]:

    from megatron_mvmoe.models.specs import build_moe_layer

    layers = {}
    for variant in VARIANTS:
        config = make_config(args, variant)
        layers[variant] = build_moe_layer(config, pgs, use_te=config.moe_grouped_gemm).to(device)
    return layers


def step(layer, x) -> None:
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.float().sum().backward()
    layer.zero_grad(set_to_none=True)


def saved_activation_bytes(layer, x) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = x.detach().requires_grad_(True)
        out, _ = layer(x)
    out.float().sum().backward()
    layer.zero_grad(set_to_none=True)
    return total[0]


def peak_bytes(layer, x, platform) -> int:
    if not platform.is_cuda():
        return saved_activation_bytes(layer, x)
    platform.reset_peak_memory()
    step(layer, x)
    platform.synchronize()
    return platform.peak_memory_bytes()


def measure(args, layers, x, platform) -> Dict[str, Dict]:
    for _ in range(args.warmup):
        for layer in layers.values():
            step(layer, x)
    times = {v: [] for v in layers}
    for _ in range(args.repeats):
        for variant, layer in layers.items():
            platform.synchronize()
            start = time.perf_counter()
            step(layer, x)
            platform.synchronize()
            times[variant].append(time.perf_counter() - start)
    return {v: {"median_s": statistics.median(t), "memory_bytes": peak_bytes(layers[v], x,
                                                                               platform)}
            for v, t in times.items()}


def report(args, results) -> Dict:
    base = results["latent"]
    flops = {v: analytic_flops(args, v) for v in VARIANTS}
    rows = {}
    for v in VARIANTS:
        rows[v] = dict(results[v], time_ratio=results[v]["median_s"] / base["median_s"],
                       memory_ratio=results[v]["memory_bytes"] / base["memory_bytes"],
                       flops_per_token=flops[v], flop_ratio=flops[v] / flops["latent"],
                       achieved_tflops=3 * flops[v] * args.tokens / results[v]["median_s"] / 1e12)
    mv = rows["multi_view"]
    return {"config": vars(args), "memory_kind": "cuda_peak" if torch.cuda.is_available()
            else "saved_activations", "variants": rows,
            "mv_time_within_tolerance": mv["time_ratio"] <= args.tolerance * mv["flop_ratio"]}


def _init_process_group(platform) -> None:
    import torch.distributed as dist

    from megatron_mvmoe.launch.local_ranks import free_port

    platform.apply_cpu_patches() if not platform.is_cuda() else None
    platform.set_local_device(0)
    dist.init_process_group(platform.backend(), rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from megatron_mvmoe import platform
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout

    _init_process_group(platform)
    try:
        pgs = initialize_layout(ParallelLayout())
        platform.seed_all(0)
        device = platform.device()
        layers = build_layers(args, pgs, device)
        x = torch.randn(args.tokens, 1, args.hidden, dtype=_dtype(args), device=device)
        out = report(args, measure(args, layers, x, platform))
    finally:
        destroy_layout()
        import torch.distributed as dist

        dist.destroy_process_group()
    _print(out, args.json)
    return 0


def _print(out: Dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"{'variant':14s} {'median_s':>9s} {'time_x':>7s} {'flop_x':>7s} "
          f"{'TFLOP/s':>8s} {'mem_MB':>8s} {'mem_x':>6s}   ({out['memory_kind']})")
    for v, r in out["variants"].items():
        print(f"{v:14s} {r['median_s']:9.4f} {r['time_ratio']:7.3f} {r['flop_ratio']:7.3f} "
              f"{r['achieved_tflops']:8.3f} {r['memory_bytes'] / 2**20:8.1f} "
              f"{r['memory_ratio']:6.3f}")
    print(f"Multi-View time ratio <= {out['config']['tolerance']} x FLOP ratio: "
          f"{out['mv_time_within_tolerance']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
