#!/usr/bin/env python
"""The seeds' model comparisons reproduced at CPU scale: trains every variant of a suite
with several seeds through the project's trainer on the three-domain corpus, then writes a
Markdown table (mean ± std of held-out perplexity per domain, differences to the reference
marked inside/outside seed noise) and loss-curve PNGs, with the exact command and wall time.

Suites (analysis/compare_variants.py):
  a  latent baseline vs Multi-Router vs Multi-View (+ stop-gradient ablation)     (seed 000)
  b  dense, SMoE, fine-grained, MH-MoE h=2/h=3, shared expert, head/merge ablations (seed 001)

Data: the trainer's `indexed` kind (Megatron GPTDataset over .bin/.idx). If --data-path holds
no dataset, it is built first with tools/build_corpus.py (corpus in DATA_PATH/corpus) and
tools/preprocess_data.py (BPE), so one command goes from nothing to the table:
  python tools/compare.py --suite a --seeds 3 --data-path data/compare_tok \
      --train-iters 400 --out-dir examples/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mvmoe.analysis import tool_common  # noqa: E402

REFERENCES = {"a": "latent", "b": "smoe"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=["a", "b"], required=True)
    p.add_argument("--variants", nargs="+", default=None, help="subset of the suite")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (>= 3 for noise)")
    p.add_argument("--data-path", default="data/compare_tok",
                   help="preprocessed three-domain dataset dir; built here if it has none")
    p.add_argument("--data-kind", default="indexed", choices=["indexed", "tokens"],
                   help="tokens: <domain>_<split>.npy arrays (tests only; never built)")
    p.add_argument("--corpus-mb", type=float, default=3.0,
                   help="when building: text MB per domain (build_corpus --max-mb-per-domain)")
    p.add_argument("--vocab-size", type=int, default=4096, help="when building: BPE vocab")
    p.add_argument("--bpe-train-mb", type=float, default=2.0,
                   help="when building: train MB per domain for the BPE")
    p.add_argument("--train-iters", type=int, default=150)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=int, default=0,
                   help="held-out microbatches per domain; 0 = the whole valid split of the "
                        "smallest domain (indexed data only)")
    p.add_argument("--out-dir", default="examples/results")
    p.add_argument("--save-dir", default=None,
                   help="also save each run's final checkpoint to SAVE_DIR/<variant>_seed<n> "
                        "(for tools/routing_alignment.py, mixing_intervention.py, ...)")
    p.add_argument("--timeout", type=float, default=900.0, help="per run")
    p.add_argument("--smooth", type=int, default=25, help="loss-curve moving-average window")
    p.add_argument("--render-only", action="store_true",
                   help="re-write the table and PNG from OUT_DIR/compare_<suite>.json, no training")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def run_config(variant, seed: int, args):
    from megatron_mvmoe.training.config import config_from_dict

    return config_from_dict({
        "model": dict(variant.model),
        "data": {"kind": args.data_kind, "path": args.data_path},
        "optimizer": {"lr": args.lr, "min_lr": args.lr / 10, "warmup_iters": max(1, min(10, args.train_iters // 5)),
                      "use_distributed_optimizer": False},
        "training": {"train_iters": args.train_iters, "global_batch_size": args.global_batch,
                     "micro_batch_size": args.micro_batch, "eval_interval": 0,
                     "eval_iters": args.eval_iters, "seed": seed,
                     "save": None if args.save_dir is None else os.path.join(
                         args.save_dir, f"{variant.name}_seed{seed}")},
        "logging": {"log_interval": 10 ** 9, "run_dir": None, "tensorboard": False,
                    "routing_metrics": False},
    })


def _train(rank, world_size, run):
    from megatron_mvmoe.training.pretrain import pretrain

    pg = tool_common.in_rank_setup()
    start = time.perf_counter()
    result = pretrain(run, pg)
    return {"losses": [float(x) for x in result.losses], "eval": dict(result.eval),
            "tokens_per_second": result.tokens_per_second,
            "wall_s": round(time.perf_counter() - start, 1)}


def _write(out_dir, suite, payload, results, variants, smooth=25):
    from megatron_mvmoe.analysis.compare_report import loss_curves, markdown_table
    from megatron_mvmoe.analysis.plots import plot_curves

    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"compare_{suite}")
    with open(base + ".json", "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    if not any(results.values()):
        return base
    plot = plot_curves(loss_curves(results), base + "_loss.png",
                       f"suite {suite}: training loss (mean, min-max over seeds)", smooth=smooth)
    table = markdown_table(results, {v.name: v.reference for v in variants},
                           {v.name: v.note for v in variants})
    with open(base + ".md", "w") as fh:
        fh.write(f"# Comparison suite {suite}\n\nCommand: `{payload['command']}`\n\n"
                 f"Wall time: {payload['wall_s']} s for {payload['runs_done']} runs "
                 f"(1 gloo rank each, 2 shared CPU cores){_data_line(payload)}. "
                 f"Setup: {payload['setup']}\n\n"
                 f"Held-out perplexity, mean ± std over seeds. 'inside seed noise' = the "
                 f"difference to the reference is within 2 standard errors.\n\n{table}\n"
                 f"Loss curves: `{os.path.basename(plot)}`\n")
    return base


def _data_line(payload) -> str:
    data = payload.get("data")
    if not data:
        return ""
    line = f"; data: `{data['kind']}` at `{data['path']}`"
    if data.get("built_with"):
        line += (f", built by this command in {data['build_wall_s']} s (included) with `"
                 + "` and `".join(data["built_with"]) + "`")
    return line


def _render_only(args, chosen) -> int:
    path = os.path.join(args.out_dir, f"compare_{args.suite}.json")
    if not os.path.isfile(path):
        return tool_common.fail(f"--render-only: {path} not found. Fix: run the suite first")[0]
    with open(path) as fh:
        payload = json.load(fh)
    results = {v.name: [payload["runs"][k] for k in sorted(payload["runs"])
                        if k.split("/")[0] == v.name] for v in chosen}
    base = _write(args.out_dir, args.suite, payload, results, chosen, args.smooth)
    tool_common.emit(payload, args.json, open(base + ".md").read())
    return 0


def prepare_data(args):
    """Check (tokens) or build if missing (indexed) the data; fixes args.eval_iters = 0."""
    from megatron_mvmoe.analysis.compare_data import (
        DataBuild, DataRecipe, ensure_dataset, full_eval_iters)

    if args.data_kind == "tokens":
        if not os.path.isdir(args.data_path):
            raise ValueError(f"--data-path {args.data_path!r} is not a directory. Fix: "
                             "--data-kind tokens needs existing <domain>_<split>.npy files")
        if args.eval_iters <= 0:
            raise ValueError("--eval-iters 0 (whole valid split) needs --data-kind indexed. "
                             "Fix: pass --eval-iters N")
        return DataBuild(path=args.data_path)
    recipe = DataRecipe(max_mb_per_domain=args.corpus_mb, vocab_size=args.vocab_size,
                        bpe_train_mb=args.bpe_train_mb)
    data = ensure_dataset(args.data_path, recipe)
    if args.eval_iters <= 0:
        args.eval_iters = full_eval_iters(args.data_path, args.seq_length, args.micro_batch)
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_mvmoe.analysis.compare_variants import variants as build_variants

    try:
        chosen = build_variants(args.suite, args.variants, args.seq_length)
        if args.render_only:
            return _render_only(args, chosen)
        start = time.time()
        data = prepare_data(args)
    except ValueError as err:
        return tool_common.fail(str(err))[0]
    import megatron_mvmoe.training.pretrain  # noqa: F401  (import once, before forking ranks)

    results = {v.name: [] for v in chosen}
    payload = {"suite": args.suite, "reference": REFERENCES[args.suite],
               "command": " ".join(["python", "tools/compare.py", *(argv or sys.argv[1:])]),
               "data": {"kind": args.data_kind, "path": args.data_path,
                        "built_with": data.commands, "build_wall_s": data.wall_s},
               "setup": (f"{args.train_iters} steps x {args.global_batch} seqs x "
                         f"{args.seq_length} tokens, lr {args.lr}, eval {args.eval_iters} x "
                         f"{args.micro_batch} seqs per domain"),
               "runs": {}, "errors": {}}
    for seed in range(1, args.seeds + 1):  # seed-major: partial results cover all variants
        for variant in chosen:
            key = f"{variant.name}/seed{seed}"
            try:
                run = tool_common.single_rank(_train, run_config(variant, seed, args),
                                              timeout_s=args.timeout)
                results[variant.name].append(run)
                payload["runs"][key] = run
                print(f"[compare] {key}: eval {run['eval']} ({run['wall_s']} s)",
                      file=sys.stderr, flush=True)
            except Exception as err:  # a failed variant is reported, the suite goes on
                payload["errors"][key] = f"{type(err).__name__}: {str(err)[-500:]}"
                print(f"[compare] {key} FAILED: {payload['errors'][key]}", file=sys.stderr)
            payload.update(wall_s=round(time.time() - start, 1), runs_done=len(payload["runs"]))
            base = _write(args.out_dir, args.suite, payload, results, chosen, args.smooth)
    summary = open(base + ".md").read() if os.path.exists(base + ".md") else "(no runs)"
    tool_common.emit(payload, args.json, summary)
    return 0 if not payload["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
