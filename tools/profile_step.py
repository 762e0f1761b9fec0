"""Op counts and times of steady bare training steps (issue 42 item 2: the dispatch glue).

    OMP_NUM_THREADS=1 python tools/profile_step.py                    # smoe, issue shape
    OMP_NUM_THREADS=1 python tools/profile_step.py --json --experts sequential

    OMP_NUM_THREADS=1 python tools/profile_step.py --step trainer     # the trainer's step
    OMP_NUM_THREADS=1 python tools/profile_step.py --steps 1 --sites 30   # where the copies are

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

from megatron_mvmoe.training.adam_impl import IMPL_FLAGS

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
    p.add_argument("--torch-adam-impl", choices=list(IMPL_FLAGS),
                   help="the AdamW of the step (optimizer.torch_adam_impl); unset: the bare "
                   "step's foreach, the trainer's configured default")
    p.add_argument("--sites", type=int, default=0, metavar="N",
                   help="also list the N busiest call sites (op <- its Python / autograd "
                        "parents) of the glue ops and aten::mul (profiles with_stack: slower)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def op_table(prof) -> Dict[str, Dict[str, float]]:
    return {e.key: {"count": e.count, "self_s": e.self_cpu_time_total / 1e6}
            for e in prof.key_averages()}


def _site_of(event, depth: int = 3) -> str:
    """`op <- parent <- ...`: the op's nearest Python frames and autograd nodes, skipping
    torch's own plumbing (aten ops, built-ins, Module.__call__)."""
    chain, parent = [], event.cpu_parent
    while parent is not None and len(chain) < depth:
        name = parent.name
        if not (name.startswith(("aten::", "<built-in", "torch/")) or "module.py" in name):
            chain.append(name.replace("autograd::engine::evaluate_function: ", "")[:70])
        parent = parent.cpu_parent
    return " <- ".join([event.name, *chain])


def call_sites(prof, names, top: int) -> Dict[str, Dict[str, float]]:
    """The `top` call sites of `names` by call count, with their self CPU seconds."""
    sites: Dict[str, Dict[str, float]] = {}
    for event in prof.events():
        if event.name in names:
            site = sites.setdefault(_site_of(event), {"count": 0, "self_s": 0.0})
            site["count"] += 1
            site["self_s"] += event.self_cpu_time_total / 1e6
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]["count"])[:top])


def _pick(table, names):
    return {n: table[n] for n in names if n in table}


def measure(rank: int, world: int, args) -> Dict:
    from torch.profiler import ProfilerActivity, profile

    from megatron_mvmoe.training import step_bench as sb

    torch.set_num_threads(1)
    raw = sb.raw_run(args.shape, args.variant)
    if args.torch_adam_impl:
        raw["optimizer"] = dict(torch_adam_impl=args.torch_adam_impl)
    run = sb.run_config(raw)
    config, pgs = sb.rank_setup(run)
    if args.experts != "built":
        config.cpu_grouped_experts = args.experts == "grouped"
    if args.step == "trainer":
        trainer = sb.TrainerStep(run, pgs, config)
        model, step = trainer.loop.trainer.unwrapped()[0], trainer
    else:
        bare = sb.BareStep(run, pgs, config=config, adam_impl=args.torch_adam_impl or "foreach")
        batch = sb.one_batch(run)
        model, step = bare.model, lambda: bare(batch)
    experts = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__ in ("SequentialMLP", "GroupedMatmulExperts",
                                              "TEGroupedMLP")})
    for _ in range(args.warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=args.sites > 0) as prof:
        for _ in range(args.steps):
            step()
    table = op_table(prof)
    total = sum(v["self_s"] for v in table.values())
    if args.step == "trainer":
        trainer.close()
    return {"shape": args.shape, "variant": args.variant, "step": args.step, "experts": experts,
            "torch_adam_impl": args.torch_adam_impl,
            "steps": args.steps, "self_cpu_s_total": total,
            "glue": _pick(table, GLUE_OPS), "matmul": _pick(table, MATMUL_OPS),
            "trainer": _pick(table, TRAINER_OPS),
            "top": dict(sorted(table.items(), key=lambda kv: -kv[1]["self_s"])[:25]),
            "sites": call_sites(prof, set(GLUE_OPS) | {"aten::mul"}, args.sites)
            if args.sites else {}}


def _rank_entry(rank, world, args):
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the loop's progress lines: not the result
        return measure(rank, world, args)


def report(r: Dict) -> str:
    lines = [f"{r['variant']} at shape {r['shape']}, {r['step']} step, experts "
             f"{r['experts']}, AdamW {r['torch_adam_impl'] or 'unset'}: {r['steps']} "
             f"steps, self CPU total {r['self_cpu_s_total']:.3f} s"]
    for group in ("glue", "matmul", "trainer"):
        lines.append(f"{group}:")
        for name, v in sorted(r[group].items(), key=lambda kv: -kv[1]["self_s"]):
            lines.append(f"  {name:32s} {v['count']:7d} calls {v['self_s']:8.3f} s")
    if r.get("sites"):
        lines.append("call sites (calls, self s):")
        lines += [f"  {v['count']:6d} {v['self_s']:7.3f}  {site}" for site, v in r["sites"].items()]
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
