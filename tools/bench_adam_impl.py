"""torch AdamW's CPU implementations (optimizer.torch_adam_impl) on one model's parameters.

    OMP_NUM_THREADS=1 python tools/bench_adam_impl.py --rounds 5 --steps 5

Builds the smoe model of training/step_bench.py at --shape (1 gloo rank, 1 thread), gives
copies of its parameters random gradients, and times optimizer.step() of for_loop, foreach
and fused in rounds (the order fixed, each round fresh parameters from one seed, 2 warm-up
steps), in process CPU time; prints each impl's median and min ms per step and the largest
|difference| of fused's and foreach's parameters from the for-loop's after the timed steps.
Not a test: a benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List

import torch

IMPLS = ("for_loop", "foreach", "fused")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["issue", "wide"], default="issue")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    return p.parse_args(argv)


def _stepped(shapes, impl: str, steps: int, run) -> tuple:
    """(seconds per step, the parameters after 2 + steps steps) of one impl."""
    from megatron_mvmoe.training.adam_impl import IMPL_FLAGS

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    foreach, fused = IMPL_FLAGS[impl]
    o = run.optimizer
    adam = torch.optim.AdamW(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                             eps=o.adam_eps, weight_decay=o.weight_decay, foreach=foreach,
                             fused=fused)
    for _ in range(2):
        adam.step()
    start = time.process_time()
    for _ in range(steps):
        adam.step()
    return (time.process_time() - start) / steps, params


def measure(rank: int, world: int, args) -> Dict:
    from megatron_mvmoe.training import step_bench as sb

    torch.set_num_threads(1)
    run = sb.run_config(sb.raw_run(args.shape, "smoe"))
    config, pgs = sb.rank_setup(run)
    shapes = [p.shape for p in sb.BareStep(run, pgs, config=config).params]
    seconds: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        final = {}
        for impl in IMPLS:
            spent, final[impl] = _stepped(shapes, impl, args.steps, run)
            seconds[impl].append(spent)
    diff = {impl: max(float((a - b).abs().max()) for a, b in zip(final[impl], final["for_loop"]))
            for impl in IMPLS[1:]}
    return {"parameters": sum(torch.Size(s).numel() for s in shapes), "tensors": len(shapes),
            "seconds": seconds, "max_abs_diff_from_for_loop": diff}


def main(argv: List[str] = None) -> int:
    from megatron_mvmoe.launch.local_ranks import run_distributed

    args = parse_args(sys.argv[1:] if argv is None else argv)
    r = run_distributed(measure, 1, timeout_s=3600, args=(args,), daemon=False)[0]
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['parameters']:,} parameters in {r['tensors']} tensors, {args.steps} steps x "
          f"{args.rounds} rounds, CPU time")
    for impl in IMPLS:
        v = sorted(r["seconds"][impl])
        print(f"  {impl:9s} median {1e3 * v[len(v) // 2]:6.1f} ms/step, min {1e3 * v[0]:6.1f}"
              + (f", max |param - for_loop's| {r['max_abs_diff_from_for_loop'][impl]:.2e}"
                 if impl != "for_loop" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
