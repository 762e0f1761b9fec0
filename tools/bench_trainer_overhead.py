"""The trainer's step against the bare model step of the same model and batch (issue 42 item 3).

    OMP_NUM_THREADS=1 python tools/bench_trainer_overhead.py                 # 1 rank
    OMP_NUM_THREADS=1 python tools/bench_trainer_overhead.py --world 2 --ep 2 --json
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/bench_trainer_overhead.py --ep 2

Builds the smoe baseline at issue 42's shape (training/step_bench.py: 4 layers, D 256, 4
heads with QK-norm, 8 SwiGLU experts of width 512, top-2, vocab 4096, seq 256, 1024 tokens
per step per rank, fp32, dropout off) twice from the same seed: (a) the bare step (forward,
token-mean loss, backward, clip 1.0, torch AdamW as Megatron-Core builds it), (b) the pretrain loop's iteration with
the run's defaults (DDP, Megatron's optimizer, the schedule, the NaN check, the progress
line every log_interval steps, Megatron's mock data). Rounds interleave (a) and (b) with the
order rotated; it prints seconds per step, the per-round overhead (b) / (a) - 1 with its
median and spread, the fastest (b) round over the fastest (a) round (on a shared machine
contention only adds time: the fastest rounds are the least disturbed), and where (b)'s
time goes (data, forward/backward, grad reduction, optimizer, logging, other). One thread
per rank (--threads). Not a test: a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import torch

from megatron_mvmoe.training.adam_impl import IMPL_FLAGS


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["issue", "wide"], default="issue")
    p.add_argument("--variant", default="smoe", help="moe_variant (config/variants.py)")
    p.add_argument("--world", type=int, default=1, help="gloo ranks spawned here (not torchrun)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="steps per stepper per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: each rank's process CPU time (the cores are shared); wall")
    p.add_argument("--log-interval", type=int,
                   help="the run's logging.log_interval (default: the config's default)")
    p.add_argument("--torch-adam-impl", choices=list(IMPL_FLAGS),
                   default="default", help="optimizer.torch_adam_impl of the trainer; the "
                   "bare step runs the same AdamW")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def measure(rank: int, world: int, args: argparse.Namespace) -> Dict:
    from megatron_mvmoe.training import step_bench as sb

    torch.set_num_threads(args.threads)
    raw = sb.raw_run(args.shape, args.variant, ep=args.ep, world=world,
                     log_interval=args.log_interval)
    raw.setdefault("optimizer", {})["torch_adam_impl"] = args.torch_adam_impl
    run = sb.run_config(raw)
    config, pgs = sb.rank_setup(run)
    bare = sb.BareStep(run, pgs, adam_impl=args.torch_adam_impl)  # the Adam the trainer runs
    batch = sb.one_batch(run, seed=rank)
    clock = sb.CLOCKS[args.clock]
    trainer = sb.TrainerStep(run, pgs, config, clock)
    try:
        times = sb.interleaved({"bare": lambda: bare(batch), "trainer": trainer},
                               args.rounds, args.steps, clock=clock,
                               after_warmup=trainer.reset_clock)
    finally:
        trainer.close()
    steps = trainer.steps_timed()
    return {"rank": rank, "world": world, "ep": args.ep, "shape": args.shape,
            "variant": args.variant, "log_interval": run.logging.log_interval,
            "torch_adam_impl": args.torch_adam_impl,
            "clock": args.clock, "threads": args.threads, "rounds": args.rounds,
            "steps_per_round": args.steps,
            "seconds_per_step": times,
            "trainer_over_bare": sb.ratio_summary(times["trainer"], times["bare"]),
            # contention only ever adds time: the fastest rounds' ratio is the least disturbed
            "fastest_trainer_over_fastest_bare": min(times["trainer"]) / min(times["bare"]),
            "trainer_phase_seconds_per_step": {k: v / steps
                                               for k, v in trainer.clock.seconds.items()}}


def _rank_entry(rank: int, world: int, args) -> Dict:
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the loop's progress lines: not the result
        return measure(rank, world, args)


def results(args) -> List[Dict]:
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        from megatron_mvmoe.platform import apply_cpu_patches

        apply_cpu_patches()
        dist.init_process_group("gloo")
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, _rank_entry(dist.get_rank(), dist.get_world_size(), args))
        return out if dist.get_rank() == 0 else []
    from megatron_mvmoe.launch.local_ranks import run_distributed

    return run_distributed(_rank_entry, args.world, timeout_s=3600, args=(args,), daemon=False)


def report(rows: List[Dict]) -> str:
    first = rows[0]
    r = first["trainer_over_bare"]
    lines = [f"{first['variant']} at shape {first['shape']}, world {first['world']}, EP "
             f"{first['ep']}, log_interval {first['log_interval']}, clock {first['clock']} "
             "(rank 0 shown)",
             "bare s/step per round:    " + " ".join(f"{t:.3f}" for t in
                                                   first["seconds_per_step"]["bare"]),
             "trainer s/step per round: " + " ".join(f"{t:.3f}" for t in
                                                   first["seconds_per_step"]["trainer"]),
             f"trainer / bare per round: " + " ".join(f"{x:.3f}" for x in r["per_round"]) +
             f"  median {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}] -> overhead "
             f"{100 * (r['median'] - 1):+.1f} %",
             f"fastest trainer round / fastest bare round: "
             f"{first['fastest_trainer_over_fastest_bare']:.3f}",
             "trainer step breakdown (s/step): " + ", ".join(
                 f"{k} {v:.4f}" for k, v in first["trainer_phase_seconds_per_step"].items())]
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows = results(args)
    if not rows:
        return 0
    print(json.dumps(rows, indent=1) if args.json else report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
