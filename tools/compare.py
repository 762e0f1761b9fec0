#!/usr/bin/env python
"""The seeds' model comparisons reproduced at CPU scale: trains every variant of a suite
with several seeds through the project's trainer on the three-domain corpus, then writes a
Markdown table (held-out perplexity per domain, mean ± std over seeds; paired per-seed
differences to the reference with 95 % t intervals and the smallest detectable difference)
and a table of the papers' orderings (appears / reversed / not resolved), loss-curve PNGs,
the exact command and wall times.

Suites (analysis/compare/suites.py):
  a   latent baseline vs Multi-Router vs Multi-View (+ stop-gradient ablation)    (seed 000)
  b   dense, SMoE, fine-grained, MH-MoE h=2/h=3, shared expert, head/merge ablations,
      D = 96 so that h = 3 sub-tokens are 32 wide                                (seed 001)
  t3  seed 001 Table 3: dense, SMoE, fine-grained, MH-MoE h=2/h=3 with BitNet b1.58
  c   beyond the papers: Multi-View R = K = 3 and 4, Multi-View on fine-grained experts

Resumable: every finished run is a JSON file in --runs-dir named by a hash of the variant,
seed and setup; a rerun of the same command trains only the missing runs (interrupt it at
any time, rerun it in the next session). With --save-dir and --save-interval a run also
checkpoints and a killed run resumes from its last checkpoint (the trainer's bit-identical
resume). Defaults are the main job's scale (1000 steps of 16 x 128 tokens, 5 seeds).

Data: the trainer's `indexed` kind (Megatron GPTDataset over .bin/.idx). If --data-path holds
no dataset, it is built first with tools/build_corpus.py (corpus in DATA_PATH/corpus) and
tools/preprocess_data.py (BPE), so one command goes from nothing to the table:
  python tools/compare.py --suite a --data-path data/compare_tok --out-dir examples/results
  python tools/compare.py --suite t3 --data-path data/compare_tok --out-dir examples/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from megatron_mvmoe.analysis.compare.suites import REFERENCES, SUITES
from megatron_mvmoe.toolkit import output, specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), required=True)
    p.add_argument("--variants", nargs="+", default=None, help="subset of the suite")
    p.add_argument("--seeds", type=int, default=5,
                   help="seeds per variant (>= 2 for a paired interval; 5 by default)")
    p.add_argument("--data-path", default="data/compare_tok",
                   help="preprocessed three-domain dataset dir; built here if it has none")
    p.add_argument("--data-kind", default="indexed", choices=["indexed", "tokens"],
                   help="tokens: <domain>_<split>.npy arrays (tests only; never built)")
    p.add_argument("--corpus-mb", type=float, default=3.0,
                   help="when building: text MB per domain (build_corpus --max-mb-per-domain)")
    p.add_argument("--vocab-size", type=int, default=4096, help="when building: BPE vocab")
    p.add_argument("--bpe-train-mb", type=float, default=2.0,
                   help="when building: train MB per domain for the BPE")
    p.add_argument("--train-iters", type=int, default=1000, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per microbatch")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak LR (cosine to LR/10)")
    p.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="default: 5 %% of --train-iters (50 at 1000, the main job's)")
    p.add_argument("--eval-iters", type=int, default=0,
                   help="held-out microbatches per domain; 0 = the whole valid split of the "
                        "smallest domain (indexed data only)")
    p.add_argument("--out-dir", default="examples/results",
                   help="where compare_<suite>.md/.json/_loss.png are written")
    p.add_argument("--runs-dir", default="examples/results/compare_runs",
                   help="resumable store of finished runs (one JSON per run; the default is "
                        "committed, so comparisons continue across sessions and machines)")
    p.add_argument("--fresh", action="store_true",
                   help="retrain every run even when --runs-dir holds it")
    p.add_argument("--save-dir", default=None,
                   help="also save each run's checkpoints to SAVE_DIR/<variant>_seed<n> "
                        "(for tools/routing_alignment.py, mixing_intervention.py, ...)")
    p.add_argument("--save-interval", type=int, default=0,
                   help="with --save-dir: checkpoint every N steps, and resume a killed run "
                        "from its last checkpoint (0 = only the final one)")
    p.add_argument("--downstream", nargs="+", default=None, metavar="TASK",
                   help="also score each run's final checkpoint (needs --save-dir) on these "
                        "lm-eval tasks ('standard' = the ten local benchmarks, "
                        "tools/lm_eval_run.py): a table of per-task scores and the macro mean "
                        "with paired differences (analysis/compare/downstream.py)")
    p.add_argument("--downstream-limit", type=int, default=50,
                   help="items per downstream task (per MMLU subject); default 50")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--smooth", type=int, default=25, help="loss-curve moving-average window")
    p.add_argument("--from-store", action="store_true",
                   help="write the tables from the runs --runs-dir holds, training nothing "
                        "(partial results while a comparison spans sessions); the missing "
                        "runs are listed in the table")
    p.add_argument("--render-only", action="store_true",
                   help="re-write the table and PNG from OUT_DIR/compare_<suite>.json, no training")
    p.add_argument("--json", action="store_true",
                   help="print the payload (runs, orderings, errors) as JSON on stdout")
    return p.parse_args(argv)


def warmup_iters(args) -> int:
    if args.lr_warmup_iters is not None:
        return args.lr_warmup_iters
    return max(1, min(args.train_iters // 20, args.train_iters - 1))


def setup(args) -> dict:
    """What every run of the suite shares (part of each run's identity in the store)."""
    return {"train_iters": args.train_iters, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "seq_length": args.seq_length, "lr": args.lr,
            "warmup_iters": warmup_iters(args), "eval_iters": args.eval_iters,
            "data": data_identity(args.data_path)}


def data_identity(path: str) -> str:
    """The dataset as a run's identity knows it: its path relative to the checkout (where
    this command builds it from the same recipe, so a clone anywhere finds the committed
    runs), or the absolute path of data outside the checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else full


def run_config(variant, seed: int, args):
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.training.warm_start import has_checkpoint

    save = None if args.save_dir is None else os.path.join(args.save_dir,
                                                           f"{variant.name}_seed{seed}")
    return config_from_dict({
        "model": dict(variant.model),
        "data": {"kind": args.data_kind, "path": args.data_path},
        "optimizer": {"lr": args.lr, "min_lr": args.lr / 10, "warmup_iters": warmup_iters(args),
                      "use_distributed_optimizer": False},
        "training": {"train_iters": args.train_iters, "global_batch_size": args.global_batch,
                     "micro_batch_size": args.micro_batch, "eval_interval": 0,
                     "eval_iters": args.eval_iters, "seed": seed, "save": save,
                     "save_interval": args.save_interval if save else 0,
                     "load": save if save and has_checkpoint(save) else None},
        "logging": {"log_interval": 10 ** 9, "run_dir": None, "tensorboard": False,
                    "routing_metrics": False},
    })


def _train(rank, world_size, run):
    from megatron_mvmoe.training.pretrain import pretrain

    pg = specs.in_rank_setup()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's step lines: progress, and
        result = pretrain(run, pg)                 # stdout stays pure JSON under --json
    return {"losses": [float(x) for x in result.losses], "eval": dict(result.eval),
            "first_step": result.first_step, "tokens_per_second": result.tokens_per_second,
            "wall_s": round(time.perf_counter() - start, 1)}


def _write(out_dir, suite, payload, results, variants, smooth=25):
    from megatron_mvmoe.analysis.compare.report import (loss_curves, markdown_table,
                                                        ordering_rows, orderings_table)
    from megatron_mvmoe.analysis.compare.suites import ORDERINGS
    from megatron_mvmoe.analysis.plots import plot_curves

    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"compare_{suite}")
    payload["orderings"] = ordering_rows(results, ORDERINGS[suite])
    output.write_json_atomic(base + ".json", payload)
    if not any(results.values()):
        return base
    plot = plot_curves(loss_curves(results), base + "_loss.png",
                       f"suite {suite}: training loss (mean, min-max over seeds)", smooth=smooth)
    table = markdown_table(results, {v.name: v.reference for v in variants},
                           {v.name: v.note for v in variants}) + _downstream_section(
                               results, {v.name: v.reference for v in variants})
    walls = [run["wall_s"] for run in payload["runs"].values()]
    with open(base + ".md", "w") as fh:
        fh.write(f"# Comparison suite {suite}\n\nCommand: `{payload['command']}`\n\n"
                 f"Wall time: {payload['wall_s']} s in this invocation, "
                 f"{sum(walls):.0f} s of training over {len(walls)} runs in all "
                 f"({sum(walls) / max(1, len(walls)):.0f} s per run; 1 gloo rank each, "
                 f"2 shared CPU cores{_reuse_line(payload)}){_data_line(payload)}. "
                 f"Setup: {payload['setup']}\n\n{_missing_line(payload)}"
                 "Held-out perplexity, mean ± std over seeds. Unpaired: 'inside seed noise' "
                 "= within 2 standard errors. Paired: per-seed differences (same data order), "
                 "95 % t interval, and the smallest difference the design detects at 80 % "
                 f"power.\n\n{table}\n## The papers' orderings\n\n"
                 "'appears' = the paired 95 % interval of (better - worse) lies below 0, "
                 "'reversed' = above 0, 'not resolved' = it contains 0 (a true difference "
                 "smaller than the detectable one is likely missed).\n\n"
                 f"{orderings_table(payload['orderings'])}\nLoss curves: "
                 f"`{os.path.basename(plot)}`\n")
    return base


def _downstream_section(results, references) -> str:
    from megatron_mvmoe.analysis.compare.downstream import downstream_table

    if not any(run.get("downstream") for runs in results.values() for run in runs):
        return ""
    spec = next(run["downstream"]["spec"] for runs in results.values() for run in runs
                if run.get("downstream"))
    return (f"\n### Downstream (lm-eval, {', '.join(spec['tasks'])}; first {spec['limit']} "
            "items per task, zero-shot), points, mean ± std over seeds; paired per-seed Δ of "
            "the macro mean, 95 % t interval (positive = better than the reference). Near "
            "chance at this scale: the last row is each task's chance level.\n\n"
            + downstream_table(results, references))


def _missing_line(payload) -> str:
    missing = payload.get("missing") or []
    if not missing:
        return ""
    total = len(missing) + len(payload["runs"])
    seeds: dict = {}
    for name in missing:  # "variant/seed3" -> {variant: [3, ...]}
        variant, seed = name.split("/seed")
        seeds.setdefault(variant, []).append(seed)
    listed = "; ".join(f"{v} seed {', '.join(s)}" for v, s in seeds.items())
    return (f"**Partial (--from-store): {len(payload['runs'])} of {total} runs are in the "
            f"store; not yet trained: {listed}.** Every statistic below uses only the seeds "
            "each variant has (paired ones: seeds both sides have).\n\n")


def _reuse_line(payload) -> str:
    if "runs_dir" not in payload:  # written by the harness before the run store existed
        return "; re-rendered with --render-only from the runs this command trained"
    return (f"; {len(payload.get('reused', []))} runs reused from earlier invocations "
            f"via `{payload['runs_dir']}`")


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
        return output.fail(f"--render-only: {path} not found. Fix: run the suite first")[0]
    with open(path) as fh:
        payload = json.load(fh)
    for key, run in payload["runs"].items():  # tables written before runs carried a seed
        run.setdefault("seed", int(key.split("/seed")[1]))
    results = {v.name: sorted((run for key, run in payload["runs"].items()
                               if key.split("/")[0] == v.name), key=lambda r: r["seed"])
               for v in chosen}
    base = _write(args.out_dir, args.suite, payload, results, chosen, args.smooth)
    output.emit(payload, args.json, open(base + ".md").read())
    return 0


def prepare_data(args):
    """Check (tokens) or build if missing (indexed) the data; fixes args.eval_iters = 0."""
    from megatron_mvmoe.analysis.compare.data import (DataBuild, DataRecipe, ensure_dataset,
                                                      full_eval_iters)

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
    from megatron_mvmoe.analysis.compare.suites import variants as build_variants

    try:
        if args.downstream and not args.save_dir:
            raise ValueError("--downstream scores each run's checkpoint. Fix: add --save-dir "
                             "DIR (runs already stored without one are trained again there "
                             "only with --fresh)")
        chosen = build_variants(args.suite, args.variants, args.seq_length)
        if args.render_only:
            return _render_only(args, chosen)
        start = time.time()
        data = prepare_data(args)
    except ValueError as err:
        return output.fail(str(err))[0]
    import megatron_mvmoe.training.pretrain  # noqa: F401  (import once, before forking ranks)

    from megatron_mvmoe.analysis.compare.store import RunStore, run_key

    store, shared = RunStore(args.runs_dir), setup(args)
    results = {v.name: [] for v in chosen}
    payload = {"suite": args.suite, "reference": REFERENCES[args.suite],
               "command": " ".join(["python", "tools/compare.py", *(argv or sys.argv[1:])]),
               "data": {"kind": args.data_kind, "path": args.data_path,
                        "built_with": data.commands, "build_wall_s": data.wall_s},
               "setup": (f"{args.train_iters} steps x {args.global_batch} seqs x "
                         f"{args.seq_length} tokens, lr {args.lr} (warmup "
                         f"{warmup_iters(args)}), eval {args.eval_iters} x "
                         f"{args.micro_batch} seqs per domain, {args.seeds} seeds"),
               "runs_dir": args.runs_dir, "runs": {}, "reused": [], "missing": [],
               "errors": {}}
    for seed in range(1, args.seeds + 1):  # seed-major: partial results cover all variants
        for variant in chosen:
            run_one(variant, seed, args, store, run_key(variant.name, variant.model, seed,
                                                       shared), results, payload)
            payload.update(wall_s=round(time.time() - start, 1), runs_done=len(payload["runs"]))
            base = _write(args.out_dir, args.suite, payload, results, chosen, args.smooth)
    summary = open(base + ".md").read() if os.path.exists(base + ".md") else "(no runs)"
    output.emit(payload, args.json, summary)
    return 0 if not payload["errors"] else 1


def run_one(variant, seed, args, store, key, results, payload) -> None:
    """Reuse the stored run or train it (and store it); a failure is recorded, not raised."""
    name = f"{variant.name}/seed{seed}"
    run = None if args.fresh else store.load(key)
    if run is not None:
        payload["reused"].append(name)
        print(f"[compare] {name}: reused {store.path(key)}", file=sys.stderr, flush=True)
    elif args.from_store:
        payload["missing"].append(name)
        print(f"[compare] {name}: not in {args.runs_dir} (--from-store: not trained)",
              file=sys.stderr, flush=True)
        return
    else:
        try:
            run = dict(specs.single_rank(_train, run_config(variant, seed, args),
                                         timeout_s=args.timeout), seed=seed, key=key)
            store.save(key, run)
            print(f"[compare] {name}: eval {run['eval']} ({run['wall_s']} s)",
                  file=sys.stderr, flush=True)
        except Exception as err:  # a failed variant is reported, the suite goes on
            payload["errors"][name] = f"{type(err).__name__}: {str(err)[-500:]}"
            print(f"[compare] {name} FAILED: {payload['errors'][name]}", file=sys.stderr)
            return
    if args.downstream:
        score_downstream(run, variant, seed, args, store, key, payload)
    results[variant.name].append(run)
    payload["runs"][name] = run


def score_downstream(run, variant, seed, args, store, key, payload) -> None:
    """The run's final checkpoint on --downstream tasks, unless stored with the same spec."""
    from megatron_mvmoe.analysis.compare.downstream import evaluate_checkpoint, spec
    from megatron_mvmoe.evaluation.benchmark_tasks import expand

    tasks = expand(args.downstream)
    if (run.get("downstream") or {}).get("spec") == spec(tasks, args.downstream_limit):
        return
    name = f"{variant.name}/seed{seed}"
    try:
        run["downstream"] = evaluate_checkpoint(
            os.path.join(args.save_dir, f"{variant.name}_seed{seed}"), tasks,
            args.downstream_limit)
        store.save(key, run)
        print(f"[compare] {name}: downstream mean {run['downstream']['mean']:.4f} "
              f"({run['downstream']['seconds']} s)", file=sys.stderr, flush=True)
    except Exception as err:  # reported with the run, the suite goes on
        payload["errors"][name + " downstream"] = f"{type(err).__name__}: {str(err)[-500:]}"


if __name__ == "__main__":
    sys.exit(main())
