"""Training stall per checkpoint save, synchronous vs --async-save, measured side by side.

    python tools/bench_ckpt_save.py --rounds 3 --json

Each round trains the same run three times on gloo ranks, in interleaved order (no saves,
sync saves, async saves; the order rotates every round so drift hits every variant): the
stall of a variant is its extra wall time over the no-save run divided by its number of
saves. Printed: per round the sync and async stall per save and their ratio, then the
median ratio and the spread (min..max) of the per-round ratios. The machine is noisy; the
spread is the honest figure.

Design choices:
- The wall time is the training loop's only (pretrain's time from the first to the last
  step, via the on_step hook), so model building and data loading do not dilute it.
- The async run's last save is waited for inside the loop (pretrain publishes it before
  returning), so a save still running at the end is counted, not hidden.
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
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("none", "sync", "async")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs all three variants)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (EP = world)")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--save-interval", type=int, default=3, help="steps between saves")
    p.add_argument("--hidden-size", type=int, default=256, help="model width (checkpoint size)")
    p.add_argument("--num-experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _raw(args, tokens: str) -> Dict:
    return dict(model=dict(preset="tiny_smoe", vocab_size=512, seq_length=32,
                           hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           moe_ffn_hidden_size=2 * args.hidden_size,
                           num_experts=args.num_experts),
                parallel=dict(ep=args.world, distributed_timeout_seconds=300),
                data=dict(kind="tokens", path=tokens),
                optimizer=dict(lr=1e-3, min_lr=1e-4, warmup_iters=1),
                training=dict(train_iters=args.steps, global_batch_size=8, micro_batch_size=2,
                              eval_interval=0, eval_iters=0),
                logging=dict(log_interval=args.steps, tensorboard=False, routing_metrics=False))


def _variant(raw: Dict, variant: str, root: str, interval: int) -> Dict:
    raw = copy.deepcopy(raw)
    if variant != "none":
        raw["training"].update(save=root, save_interval=interval,
                               async_save=variant == "async")
    return raw


def measure(args) -> Dict:
    sys.path.insert(0, str(REPO / "tests" / "training"))
    work = args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        return _measure_in(args, work)
    finally:
        if args.workdir is None:  # 9 runs of checkpoints: do not leave them in /tmp
            shutil.rmtree(work, ignore_errors=True)


def _measure_in(args, work: str) -> Dict:
    from megatron_mvmoe.launch.local_ranks import run_distributed
    from megatron_mvmoe.training.loop_timing import loop_seconds

    from textdata import build_token_dir

    raw = _raw(args, build_token_dir(os.path.join(work, "tokens")))
    saves = args.steps // args.save_interval  # the final save coincides with the last interval
    rounds = []
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        seconds = {}
        for variant in order:
            root = os.path.join(work, f"ck_{r}_{variant}")
            seconds[variant] = run_distributed(
                loop_seconds, args.world, timeout_s=900, daemon=False,
                args=(_variant(raw, variant, root, args.save_interval),))[0]
            print(f"round {r + 1}/{args.rounds} {variant}: {seconds[variant]:.2f} s",
                  file=sys.stderr, flush=True)
        stall = {v: (seconds[v] - seconds["none"]) / saves for v in ("sync", "async")}
        rounds.append({"order": order, "seconds": seconds, "stall_per_save_s": stall,
                       "async_over_sync": stall["async"] / stall["sync"]
                       if stall["sync"] > 0 else None})
    ckpt = os.path.join(work, "ck_0_sync", f"iter_{args.steps:07d}")
    size = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(ckpt) for f in fs)
    ratios = [r["async_over_sync"] for r in rounds if r["async_over_sync"] is not None]
    return {"rounds": rounds, "saves_per_run": saves, "checkpoint_bytes": size,
            "world": args.world, "median_async_over_sync": statistics.median(ratios)
            if ratios else None, "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None)}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"checkpoint {result['checkpoint_bytes'] / 2**20:.1f} MiB, {result['saves_per_run']} "
          f"saves per run, {args.world} ranks")
    for i, r in enumerate(result["rounds"], 1):
        s = r["stall_per_save_s"]
        ratio = "n/a" if r["async_over_sync"] is None else f"{r['async_over_sync']:.2f}"
        print(f"round {i} ({'/'.join(r['order'])}): stall per save sync {s['sync']:.3f} s, "
              f"async {s['async']:.3f} s, async/sync {ratio}")
    if result["median_async_over_sync"] is not None:
        print(f"async/sync stall per save: median {result['median_async_over_sync']:.2f} "
              f"(per-round spread {result['ratio_min']:.2f}..{result['ratio_max']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
