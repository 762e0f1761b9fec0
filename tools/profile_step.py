"""Op counts and times of steady bare training steps (issue 42 item 2: the dispatch glue).

    OMP_NUM_THREADS=1 python tools/profile_step.py                    # smoe, issue shape
    OMP_NUM_THREADS=1 python tools/profile_step.py --json --experts sequential

    OMP_NUM_THREADS=1 python tools/profile_step.py --step trainer     # the trainer's step

Builds the model of training/step_bench.py (the trainer's build path, 1 gloo rank, 1 thread),
runs --warmup steps, then profiles --steps bare steps (forward, loss, backward, clip, AdamW)
or, with --step trainer, the pretrain loop's iterations, with torch.profiler on CPU and
prints, per op, the call count and self CPU time of the copy / concatenation / indexing ops
(the dispatch glue), the matrix multiplies, the trainer's own passes (grad norms, grad
buffer zeroing and accumulation, collectives, NaN checks), and the total; --experts picks
the bare step's expert implementation (built: what the fast-path rule builds; sequential /
grouped: Megatron's SequentialMLP loop or layers/grouped_experts.py on the same weights).
Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

import torch

GLUE_OPS = ("aten::copy_", "aten::cat", "aten::index", "aten::index_select", "aten::gather",
            "aten::scatter_add_", "aten::index_add_", "aten::index_put_", "aten::masked_select",
            "aten::nonzero", "aten::argsort", "aten::sort", "aten::split", "aten::to",
            "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::zeros", "aten::fill_",
            "aten::stack", "aten::repeat_interleave", "aten::embedding_dense_backward")
TRAINER_OPS = ("aten::linalg_vector_norm", "c10d::allreduce_", "aten::add_", "aten::zero_",
               "aten::isfinite")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
              "aten::matmul", "aten::linear")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["issue", "wide"], default="issue")
    p.add_argument("--variant", default="smoe")
    p.add_argument("--experts", choices=["built", "sequential", "grouped"], default="built")
    p.add_argument("--step", choices=["bare", "trainer"], default="bare",
                   help="bare: the hand-written step; trainer: the pretrain loop's iteration "
                        "(training/step_bench.py's TrainerStep, the run's defaults)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def op_table(prof) -> Dict[str, Dict[str, float]]:
    return {e.key: {"count": e.count, "self_s": e.self_cpu_time_total / 1e6}
            for e in prof.key_averages()}


def _pick(table, names):
    return {n: table[n] for n in names if n in table}


def measure(rank: int, world: int, args) -> Dict:
    from torch.profiler import ProfilerActivity, profile

    from megatron_mvmoe.training import step_bench as sb

    torch.set_num_threads(1)
    run = sb.run_config(sb.raw_run(args.shape, args.variant))
    config, pgs = sb.rank_setup(run)
    if args.experts != "built":
        config.cpu_grouped_experts = args.experts == "grouped"
    if args.step == "trainer":
        trainer = sb.TrainerStep(run, pgs, config)
        model, step = trainer.loop.trainer.unwrapped()[0], trainer
    else:
        bare, batch = sb.BareStep(run, pgs, config=config), sb.one_batch(run)
        model, step = bare.model, lambda: bare(batch)
    experts = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__ in ("SequentialMLP", "GroupedMatmulExperts",
                                              "TEGroupedMLP")})
    for _ in range(args.warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    table = op_table(prof)
    total = sum(v["self_s"] for v in table.values())
    if args.step == "trainer":
        trainer.close()
    return {"shape": args.shape, "variant": args.variant, "step": args.step, "experts": experts,
            "steps": args.steps, "self_cpu_s_total": total,
            "glue": _pick(table, GLUE_OPS), "matmul": _pick(table, MATMUL_OPS),
            "trainer": _pick(table, TRAINER_OPS),
            "top": dict(sorted(table.items(), key=lambda kv: -kv[1]["self_s"])[:25])}


def _rank_entry(rank, world, args):
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the loop's progress lines: not the result
        return measure(rank, world, args)


def report(r: Dict) -> str:
    lines = [f"{r['variant']} at shape {r['shape']}, {r['step']} step, experts "
             f"{r['experts']}: {r['steps']} "
             f"steps, self CPU total {r['self_cpu_s_total']:.3f} s"]
    for group in ("glue", "matmul", "trainer"):
        lines.append(f"{group}:")
        for name, v in sorted(r[group].items(), key=lambda kv: -kv[1]["self_s"]):
            lines.append(f"  {name:32s} {v['count']:7d} calls {v['self_s']:8.3f} s")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    from megatron_mvmoe.launch.local_ranks import run_distributed

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.step == "trainer" and args.experts != "built":
        print("profile_step: --experts applies to the bare step only. Fix: drop --experts or "
              "use --step bare", file=sys.stderr)
        return 2
    result = run_distributed(_rank_entry, 1, timeout_s=3600, args=(args,), daemon=False)[0]
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
