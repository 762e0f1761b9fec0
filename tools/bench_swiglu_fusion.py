"""Megatron's compiled SwiGLU (`bias_swiglu_impl`, torch.compile) against eager
`silu(a) * b` on this CPU, forward + backward, by call size; and the start-up cost of the
inductor probe and the first compiles (issue 42; the threshold SWIGLU_FUSION_MIN_ELEMENTS in
models/fast_paths.py comes from this table). A benchmark, not a test:

    OMP_NUM_THREADS=1 python tools/bench_swiglu_fusion.py                 # sizes, 3 rounds
    OMP_NUM_THREADS=1 python tools/bench_swiglu_fusion.py --compile-cost  # cold inductor cache
    OMP_NUM_THREADS=1 python tools/bench_swiglu_fusion.py --json

Sizes: each (rows, F) pair is timed in interleaved rounds (eager, compiled) in process CPU
time, after a warm-up with the same gradient layout as the timed calls (a stride-0 gradient
in the warm-up would make dynamo recompile inside the timed loop); the middle round is
printed. --compile-cost runs in a fresh TORCHINDUCTOR_CACHE_DIR, then again with that cache,
and counts the CPU seconds of the process and its compile workers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

SIZES = ((16, 64), (64, 128), (128, 256), (256, 512), (512, 512), (1024, 1024), (2048, 1024))
"""(rows, F): output elements 2^10 ... 2^21."""


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-cost", action="store_true",
                   help="measure the probe's and the first compiles' CPU seconds instead")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _eager(x):
    import torch.nn.functional as F

    a, b = x.chunk(2, -1)
    return F.silu(a) * b


def _per_call_us(fn, x, g, calls: int) -> float:
    for _ in range(3):
        fn(x).backward(g)
    start = time.process_time()
    for _ in range(calls):
        fn(x).backward(g)
    return (time.process_time() - start) / calls * 1e6


def sizes(rounds: int) -> List[Dict]:
    import torch
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.set_num_threads(1)
    rows_out = []
    for rows, f in SIZES:
        x = torch.randn(rows, 2 * f, requires_grad=True)
        g = torch.ones(rows, f)
        calls = min(400, max(5, int(2e7 // (rows * f))))
        us = {"eager": [], "compiled": []}
        for _ in range(rounds):
            us["eager"].append(_per_call_us(_eager, x, g, calls))
            us["compiled"].append(_per_call_us(lambda t: bias_swiglu_impl(t, None), x, g, calls))
        mid = {k: sorted(v)[len(v) // 2] for k, v in us.items()}
        rows_out.append({"rows": rows, "F": f, "elements": rows * f, "eager_us": mid["eager"],
                         "compiled_us": mid["compiled"],
                         "eager_over_compiled": mid["eager"] / mid["compiled"]})
    return rows_out


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _compile_once() -> Dict[str, float]:
    """In this process: the probe, then the fused SwiGLU at two row counts (static, dynamic)."""
    import torch
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megatron_mvmoe.platform.inductor_probe import inductor_blocker

    torch.set_num_threads(1)
    c0 = _cpu_seconds()
    blocker = inductor_blocker()
    c1 = _cpu_seconds()
    for rows in (512, 640):
        x = torch.randn(rows, 1024, requires_grad=True)
        bias_swiglu_impl(x, None).backward(torch.ones(rows, 512))
    return {"probe_cpu_s": c1 - c0, "swiglu_compile_cpu_s": _cpu_seconds() - c1,
            "blocker": blocker}


def compile_cost() -> Dict[str, Dict]:
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for label in ("cold_cache", "warm_cache"):
            run = subprocess.run([sys.executable, __file__, "--_compile-child"], env=env,
                                 capture_output=True, text=True, check=True)
            out[label] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--_compile-child"]:
        print(json.dumps(_compile_once()))
        return 0
    args = parse_args(argv)
    out = {"compile_cost": compile_cost()} if args.compile_cost else {"sizes": sizes(args.rounds)}
    if args.json:
        print(json.dumps(out, indent=1))
    elif args.compile_cost:
        for label, r in out["compile_cost"].items():
            print(f"{label}: probe {r['probe_cpu_s']:.1f} CPU s, SwiGLU forward+backward compiles "
                  f"(2 row counts) {r['swiglu_compile_cpu_s']:.1f} CPU s"
                  + (f"; probe says: {r['blocker']}" if r["blocker"] else ""))
    else:
        print("rows x F      elements  eager us  compiled us  eager/compiled")
        for r in out["sizes"]:
            print(f"{r['rows']:5d} x {r['F']:<5d} {r['elements']:9d} {r['eager_us']:9.0f} "
                  f"{r['compiled_us']:12.0f} {r['eager_over_compiled']:15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
