"""Step-time overhead of the live all-to-all metrics (logging.a2a_metrics), measured side by
side: the same run with the metrics off and on, interleaved.

    python tools/bench_a2a_metrics.py --pairs 4 --json

Each pair trains the same run twice on gloo ranks (EP = world), metrics off and on, in an
order that alternates every pair (so drift hits both); the per-pair ratio is on / off of
the training loop's wall time. Printed: every pair, then the median ratio and the spread
(min..max) of the per-pair ratios. The machine is noisy; the spread is the honest figure.
The "on" runs also time the metrics' own code on rank 0 as a share of their loop: the
per-micro-batch histogram hook, and the log-time reduction after a barrier (without it its
first all-reduce would wait for the slower rank, time the next step's first collective
waits anyway): figures that shared-machine noise slows in both their parts alike. The target is an overhead <= 1 % (docs/a2a_model.md,
"Live metrics").

Design choices:
- The wall time is the training loop's only (first step to return, via the on_step hook),
  so model building and data loading do not dilute it; the metrics' log-time reduction is
  inside it (every --log-interval steps).
- The default dispatcher is dedup_node with one rank per node: the metrics then compute all
  three semantics, two hops each, the most work they do.
- Real text: the token set of tests/training/textdata.py (Python docs + Jargon File).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4, help="interleaved (off, on) pairs")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (EP = world)")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--log-interval", type=int, default=4, help="steps between log lines")
    p.add_argument("--hidden-size", type=int, default=256, help="model width")
    p.add_argument("--num-experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--dispatcher", default="dedup_node",
                   choices=["alltoall", "dedup_rank", "dedup_node"], help="model.moe_dispatcher")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _raw(args, tokens: str) -> Dict:
    return dict(model=dict(preset="tiny_multi_view", vocab_size=512, seq_length=args.seq_length,
                           hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           moe_ffn_hidden_size=2 * args.hidden_size, latent_size=args.hidden_size // 2,
                           num_experts=args.num_experts, moe_dispatcher=args.dispatcher,
                           moe_dispatch_ranks_per_node=1),
                parallel=dict(ep=args.world, distributed_timeout_seconds=300),
                data=dict(kind="tokens", path=tokens),
                optimizer=dict(lr=1e-3, min_lr=1e-4, warmup_iters=1),
                training=dict(train_iters=args.steps, global_batch_size=8, micro_batch_size=2,
                              eval_interval=0, eval_iters=0),
                logging=dict(log_interval=args.log_interval, tensorboard=False,
                             routing_metrics=False, a2a_ranks_per_node=1))


def _timed_run(rank, world_size, raw):
    """Train; (loop wall time from the first step, seconds inside the metrics' code)."""
    import torch

    from megatron_mvmoe.training.loop_timing import loop_seconds  # first step to return
    from megatron_mvmoe.training import a2a_metrics

    spent = {"hook": 0.0, "reduce": 0.0}

    def timed(method, part):
        def wrapper(*args, **kwargs):
            if part == "reduce":  # the ranks' skew is not the metrics' cost: align them first
                torch.distributed.barrier()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return wrapper

    a2a_metrics._Layer.add = timed(a2a_metrics._Layer.add, "hook")
    a2a_metrics.A2AMonitor.reduce = timed(a2a_metrics.A2AMonitor.reduce, "reduce")
    return loop_seconds(rank, world_size, raw), spent


def measure(args) -> Dict:
    from megatron_mvmoe.launch.local_ranks import run_distributed

    sys.path.insert(0, str(REPO / "tests" / "training"))
    from textdata import build_token_dir

    work = tempfile.mkdtemp(prefix="bench_a2a_")
    try:
        raw = _raw(args, build_token_dir(os.path.join(work, "tokens")))
        pairs = []
        for i in range(args.pairs):
            seconds = {}
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                variant = copy.deepcopy(raw)
                variant["logging"]["a2a_metrics"] = on
                wall, spent = run_distributed(_timed_run, args.world, timeout_s=900,
                                              daemon=False, args=(variant,))[0]
                seconds["on" if on else "off"] = wall
                if on:
                    seconds.update({f"{part}_share": t / wall for part, t in spent.items()})
                    seconds["metrics_share"] = sum(spent.values()) / wall
            pairs.append({**seconds, "ratio": seconds["on"] / seconds["off"]})
            print(f"pair {i + 1}/{args.pairs}: off {seconds['off']:.2f} s, on "
                  f"{seconds['on']:.2f} s, on/off {pairs[-1]['ratio']:.4f}, metrics' own "
                  f"share {seconds['metrics_share']:.4%} (hook {seconds['hook_share']:.4%}, "
                  f"log-time reduce {seconds['reduce_share']:.4%})", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [p["ratio"] for p in pairs]
    shares = [p["metrics_share"] for p in pairs]
    return {"pairs": pairs, "median_ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "median_metrics_share": statistics.median(shares),
            "metrics_share_min": min(shares), "metrics_share_max": max(shares),
            "median_hook_share": statistics.median(p["hook_share"] for p in pairs),
            "median_reduce_share": statistics.median(p["reduce_share"] for p in pairs),
            "config": vars(args),
            "command": " ".join(["python", "tools/bench_a2a_metrics.py", *sys.argv[1:]])}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    for i, p in enumerate(result["pairs"], 1):
        print(f"pair {i}: off {p['off']:.2f} s, on {p['on']:.2f} s, on/off {p['ratio']:.4f}, "
              f"metrics' own share {p['metrics_share']:.4%} (hook {p['hook_share']:.4%})")
    print(f"metrics' own share, median: hook {result['median_hook_share']:.4%}, log-time "
          f"reduce {result['median_reduce_share']:.4%}")
    print(f"on/off: median {result['median_ratio']:.4f} (per-pair spread "
          f"{result['ratio_min']:.4f}..{result['ratio_max']:.4f}); metrics' own share of the "
          f"loop: median {result['median_metrics_share']:.4%} (spread "
          f"{result['metrics_share_min']:.4%}..{result['metrics_share_max']:.4%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
