"""Side-by-side timing of the Multi-View MoE kernels against their torch references.

    python tools/bench_kernels.py                      # defaults for the device found
    python tools/bench_kernels.py --tokens 16384 --experts 256 --heads 2 --topk 8 \
        --latent 512 --dtype bf16 --json

For each op (fused multi-router, mix-and-permute; forward and forward+backward) it prints
the reference time, the Triton kernel time, their ratio, and the MINIMUM bytes the op must
move (each input read once, each output written once; see `min_bytes_*`), also as a
fraction of the device's copy bandwidth measured in the same run (a large tensor clone),
or of --peak-gbs when given. On a machine without a GPU the reference is timed and the
kernel is reported as "not timed (no GPU)": the Triton interpreter measures nothing useful.
Speed is only ever reported here, side by side in one run, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from megatron_mvmoe import platform

NO_GPU = "not timed (no GPU)"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX_BYTES, F32 = 8, 4


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None,
                        help="T, tokens per call (default 16384 on GPU, 1024 on CPU)")
    parser.add_argument("--experts", type=int, default=64, help="E, routed experts")
    parser.add_argument("--heads", type=int, default=2, help="R, routing heads = views")
    parser.add_argument("--topk", type=int, default=8, help="S, experts per token")
    parser.add_argument("--latent", type=int, default=512, help="L, latent size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="logits/views dtype (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="nominal memory bandwidth in GB/s for the fractions "
                             "(default: the copy bandwidth measured in this run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    gpu = platform.is_cuda()
    args.tokens = args.tokens or (16384 if gpu else 1024)
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    for name in ("tokens", "experts", "heads", "topk", "latent", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.topk > args.experts:
        parser.error(f"--topk {args.topk} exceeds --experts {args.experts}; lower --topk")
    if args.warmup < 0 or (args.peak_gbs is not None and args.peak_gbs <= 0):
        parser.error("--warmup must be >= 0 and --peak-gbs > 0")
    return args


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    platform.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    platform.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def copy_bandwidth_gbs(device: torch.device, iters: int = 10) -> float:
    """Read + write GB/s of a 1 GiB clone: the practical ceiling for these memory-bound ops."""
    source = torch.empty(1 << 28, dtype=torch.float32, device=device)
    ms = time_ms(lambda: source.clone(), iters, 2)
    return 2 * source.numel() * F32 / (ms * 1e-3) / 1e9


def min_bytes_router(t: int, r: int, e: int, s: int, elem: int) -> Dict[str, int]:
    """Forward reads logits (+bias, alpha), writes idx, gates, mix, summed. Backward reads the
    logits, the saved slot outputs and the gates'/mix' gradients; writes the logits' gradient."""
    slot_outputs = t * s * (INDEX_BYTES + F32 + r * F32)
    forward = t * r * e * elem + 2 * e * F32 + slot_outputs + t * e * F32
    backward = t * r * e * elem + slot_outputs + t * s * (F32 + r * F32) + t * r * e * elem
    return {"fwd": forward, "fwd+bwd": forward + backward}


def min_bytes_mix(t: int, r: int, s: int, l_: int, elem: int) -> Dict[str, int]:
    """Forward reads views, mix and the row map, writes T*S rows. Backward reads the rows'
    gradient, views, mix and map; writes the views' and mix' gradients."""
    small = t * s * (r * F32 + INDEX_BYTES)
    forward = t * r * l_ * elem + small + t * s * l_ * elem
    backward = t * s * l_ * elem + t * r * l_ * elem + small + t * r * l_ * elem + t * s * r * F32
    return {"fwd": forward, "fwd+bwd": forward + backward}


def router_cases(mk, args, device, dtype) -> Dict[str, Callable]:
    t, r, e, s = args.tokens, args.heads, args.experts, args.topk
    logits = torch.randn(t, r, e, device=device).to(dtype).requires_grad_()
    bias = torch.randn(e, device=device) * 0.01
    d_gates, d_mix = torch.randn(t, s, device=device), torch.randn(t, s, r, device=device)

    def run(backend: str, backward: bool):
        def step():
            out = mk.fused_multi_router(logits, bias, s, 1.0, backend=backend)
            if backward:
                torch.autograd.backward([out.gates_TS, out.mix_TSR], [d_gates, d_mix])
        return step
    return {"fwd": lambda b: run(b, False), "fwd+bwd": lambda b: run(b, True)}


def mix_cases(mk, args, device, dtype) -> Dict[str, Callable]:
    t, r, e, s, l_ = args.tokens, args.heads, args.experts, args.topk, args.latent
    views = torch.randn(t, r, l_, device=device).to(dtype).requires_grad_()
    mix = torch.rand(t, s, r, device=device).requires_grad_()
    idx = torch.rand(t, e, device=device).topk(s, dim=1).indices.sort(dim=1).values
    rows = mk.expert_major_rows(idx, e)
    d_rows = torch.randn(t * s, l_, device=device).to(dtype)

    def run(backend: str, backward: bool):
        def step():
            out = mk.mix_and_permute(views, mix, rows.row_token_N, rows.row_slot_N,
                                     backend=backend)
            if backward:
                out.backward(d_rows)
        return step
    return {"fwd": lambda b: run(b, False), "fwd+bwd": lambda b: run(b, True)}


def measure(args) -> dict:
    import mvmoe_kernels as mk
    device, dtype = platform.device(), DTYPES[args.dtype]
    gpu = device.type == "cuda"
    bandwidth = args.peak_gbs or (copy_bandwidth_gbs(device) if gpu else None)
    elem = torch.empty((), dtype=dtype).element_size()
    ops = {
        "fused_multi_router": (router_cases(mk, args, device, dtype),
                               min_bytes_router(args.tokens, args.heads, args.experts,
                                                args.topk, elem)),
        "mix_and_permute": (mix_cases(mk, args, device, dtype),
                            min_bytes_mix(args.tokens, args.heads, args.topk, args.latent,
                                          elem)),
    }
    results = []
    for op, (cases, min_bytes) in ops.items():
        for phase, make in cases.items():
            ref_ms = time_ms(make("reference"), args.iters, args.warmup)
            kernel_ms = time_ms(make("triton"), args.iters, args.warmup) if gpu else None
            results.append(_row(op, phase, min_bytes[phase], ref_ms, kernel_ms, bandwidth))
    return {
        "device": str(device), "dtype": args.dtype,
        "shape": {"T": args.tokens, "E": args.experts, "R": args.heads, "S": args.topk,
                  "L": args.latent},
        "bandwidth_GBps": bandwidth,
        "bandwidth_source": "--peak-gbs" if args.peak_gbs else ("measured copy" if gpu else None),
        "results": results,
    }


def _row(op: str, phase: str, min_bytes: int, ref_ms: float, kernel_ms: Optional[float],
         bandwidth: Optional[float]) -> dict:
    def fraction(ms):
        if ms is None or bandwidth is None:
            return None
        return min_bytes / (ms * 1e-3) / (bandwidth * 1e9)
    return {
        "op": op, "phase": phase, "min_bytes": min_bytes,
        "reference_ms": ref_ms, "kernel_ms": kernel_ms,
        "kernel_status": "timed" if kernel_ms is not None else NO_GPU,
        "speedup": ref_ms / kernel_ms if kernel_ms else None,
        "reference_bw_fraction": fraction(ref_ms), "kernel_bw_fraction": fraction(kernel_ms),
    }


def print_table(report: dict) -> None:
    shape = ", ".join(f"{k}={v}" for k, v in report["shape"].items())
    bw = report["bandwidth_GBps"]
    print(f"device {report['device']}  dtype {report['dtype']}  {shape}  bandwidth "
          + (f"{bw:.0f} GB/s ({report['bandwidth_source']})" if bw else "n/a"))
    print(f"{'op':<20}{'phase':<9}{'min MB':>9}{'ref ms':>10}{'kernel ms':>20}{'ratio':>8}"
          f"{'ref bw%':>9}{'ker bw%':>9}")
    for row in report["results"]:
        kernel = f"{row['kernel_ms']:.3f}" if row["kernel_ms"] is not None else NO_GPU
        ratio = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        pct = [f"{100 * x:.1f}" if x is not None else "-"
               for x in (row["reference_bw_fraction"], row["kernel_bw_fraction"])]
        print(f"{row['op']:<20}{row['phase']:<9}{row['min_bytes'] / 1e6:>9.2f}"
              f"{row['reference_ms']:>10.3f}{kernel:>20}{ratio:>8}{pct[0]:>9}{pct[1]:>9}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
