"""The main job: corpus -> small BPE -> Megatron indexed datasets -> train a tiny Multi-View
MoE on CPU at EP=2 under torchrun -> per-domain perplexity -> runs/<name>/.

  python tools/run_main_job.py                      # ~3-5 min of training on 2 cores
  python tools/run_main_job.py --train-iters 40 --json
  python tools/run_main_job.py --downstream-only    # add the downstream block to a finished run

Writes runs/<name>/: config.yaml (the resolved run config), metrics.jsonl, train.log
(console of every rank), tensorboard/, loss_curve.png, results.json, checkpoints/.
Existing corpus / preprocessed directories are reused (pass --rebuild-data to redo them).

Then the final checkpoint is scored on the standard lm-eval tasks (tools/lm_eval_run.py
--tasks standard --limit N, offline, on the files scripts/setup_env.sh fetched): results.json's
"downstream" holds each task's score, stderr, items and chance level and the macro mean next
to the mean a guesser gets, labelled near chance (a toy model at this scale answers these
benchmarks about as well as guessing). --downstream-limit 0 skips it.
Checked by tests/hf/test_downstream.py::test_main_job_results_carry_downstream_beside_chance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JobError(RuntimeError):
    """A stage of the main job failed."""


def _run(cmd: List[str], log_path: str, timeout_s: float, what: str,
         result_path: Optional[str] = None) -> None:
    """Run one stage; its output goes to the log and, as progress, to stderr. With
    result_path, the stage's stdout (its --json result) goes to that file instead."""
    print(f"[main job] {what} ...", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    with open(log_path, "a") as log, open(result_path or os.devnull, "w") as result:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        streams = ({"stdout": result, "stderr": subprocess.PIPE} if result_path else
                   {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT})
        proc = subprocess.Popen(cmd, cwd=REPO, text=True, bufsize=1, **streams)
        for line in proc.stderr or proc.stdout:  # the stages print progress lines; a stage
            log.write(line)  # that hangs without output is caught by the wait below
            # Every line shows: noise is filtered where it is emitted (megatron_mvmoe/log_noise.py)
            print(f"  {line}", end="", file=sys.stderr, flush=True)
            if time.monotonic() > deadline:
                proc.kill()
                raise JobError(f"{what} did not finish within {timeout_s:.0f} s; see {log_path}")
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    if returncode != 0:
        raise JobError(f"{what} failed (exit {returncode}); last lines of {log_path}:\n"
                       + _tail(log_path))


def _tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:])


def build_data(args, log_path: str) -> str:
    corpus = os.path.join(args.data_dir, "corpus")
    tokens = os.path.join(args.data_dir, f"bpe{args.vocab_size}")
    if args.rebuild_data or not os.path.isfile(os.path.join(corpus, "manifest.json")):
        _run([sys.executable, "tools/build_corpus.py", "--out", corpus,
              "--max-mb-per-domain", str(args.max_mb_per_domain)], log_path, 900,
             "corpus build (tools/build_corpus.py)")
    if args.rebuild_data or not os.path.isfile(os.path.join(tokens, "dataset_meta.json")):
        _run([sys.executable, "tools/preprocess_data.py", "--corpus", corpus, "--out", tokens,
              "--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)], log_path, 900,
             "preprocessing (tools/preprocess_data.py)")
    return tokens


def train(args, data_path: str, run_dir: str, log_path: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "megatron_mvmoe.training.pretrain",
           "--config", args.config, "--data-path", data_path, "--run-dir", run_dir,
           "--save", os.path.join(run_dir, "checkpoints"), "--vocab-size", str(args.vocab_size),
           "--expert-model-parallel-size", str(args.ep), "--tensorboard", "true"]
    if args.train_iters is not None:
        # A shorter run keeps the schedule's shape: warm up over 5% of it (the config's 50
        # steps are 5% of its 1000), so a quick `--train-iters 40` is valid too.
        cmd += ["--train-iters", str(args.train_iters),
                "--lr-warmup-iters", str(max(1, args.train_iters // 20))]
    start = time.time()
    env_note = "OMP_NUM_THREADS=1 keeps the ranks from oversubscribing the cores"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _run(cmd, log_path, args.timeout_s, f"training under torchrun ({env_note})")
    return time.time() - start


def _records(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise JobError(f"training wrote no {path}")
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot_loss(records: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss")
    for domain in sorted({d for r in evals for d in r if d not in ("kind", "step")}):
        points = [(r["step"], r[domain]["loss"]) for r in evals if domain in r]
        ax.plot(*zip(*points), marker="o", linestyle="--", label=f"{domain} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("tiny Multi-View MoE, EP=2, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(records: List[Dict], seconds: float, args, run_dir: str) -> Dict:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train or not evals:
        raise JobError(f"{run_dir}/metrics.jsonl has no train or eval records")
    final = {d: v for d, v in evals[-1].items() if d not in ("kind", "step")}
    return {"name": args.name, "run_dir": run_dir, "steps": train[-1]["step"],
            "first_logged_loss": train[0]["loss"], "final_train_loss": train[-1]["loss"],
            "final_eval": final, "train_wall_seconds": round(seconds, 1),
            "tokens_per_second_last_window": train[-1].get("tokens_per_s"),
            "final_gamma": train[-1].get("gamma"), "ep": args.ep, "nproc": args.nproc,
            "loss_curve": os.path.join(run_dir, "loss_curve.png")}


NEAR_CHANCE = ("near chance at this scale: a toy model trained for minutes on CPU answers "
               "these benchmarks about as well as guessing; compare each score with its "
               "chance level, not with published numbers")


def score_downstream(args, run_dir: str, log_path: str) -> Dict:
    """--downstream-tasks (the standard lm-eval tasks) on the run's final checkpoint, first
    --downstream-limit items of each (of each MMLU subject)."""
    out_path = os.path.join(run_dir, "downstream.json")
    cmd = [sys.executable, "tools/lm_eval_run.py", "--load", os.path.join(run_dir, "checkpoints"),
           "--tasks", *args.downstream_tasks, "--limit", str(args.downstream_limit), "--json"]
    _run(cmd, log_path, args.timeout_s, "downstream: lm-eval tasks, offline "
         f"(tools/lm_eval_run.py --limit {args.downstream_limit})", result_path=out_path)
    with open(out_path) as fh:
        return downstream_block(json.load(fh), " ".join(["python", *cmd[1:]]))


def downstream_block(out: Dict, command: str) -> Dict:
    """results.json's downstream entry: each task's score with its chance level beside it,
    the macro mean and what guessing would give (LAMBADA, which names a word, counts 0)."""
    keys = ("split", "items", "metric", "score", "stderr", "chance")
    tasks = {task: {k: row[k] for k in keys} for task, row in out["tasks"].items()}
    guessing = [row["chance"] or 0.0 for row in tasks.values()]
    return {"label": NEAR_CHANCE, "command": command, "limit": out["limit"],
            "num_fewshot": out["num_fewshot"], "tasks": tasks, "mean": out["mean"],
            "mean_if_guessing": sum(guessing) / len(guessing), "seconds": out["seconds"]}


def downstream_lines(block: Dict) -> str:
    from megatron_mvmoe.evaluation.benchmark_tasks import score_table

    return (f"downstream, first {block['limit']} items per task ({block['label']}):\n"
            + score_table(block) + f"\nmacro mean {block['mean']:.4f}; guessing gives "
            f"{block['mean_if_guessing']:.4f}")


def write_results(run_dir: str, results: Dict) -> None:
    with open(os.path.join(run_dir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="main_job")
    p.add_argument("--config", default="examples/tiny_cpu.yaml")
    p.add_argument("--data-dir", default="data/main_job")
    p.add_argument("--max-mb-per-domain", type=float, default=3.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--train-iters", type=int, default=None, help="default: the config's")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--rebuild-data", action="store_true")
    p.add_argument("--downstream-limit", type=int, default=10,
                   help="items per standard lm-eval task (per MMLU subject) scored on the final "
                        "checkpoint (default 10; 0 skips)")
    p.add_argument("--downstream-tasks", nargs="+", default=["standard"],
                   help="lm_eval_run.py task names (default: standard, the ten local tasks)")
    p.add_argument("--downstream-only", action="store_true",
                   help="no training: score the finished run's checkpoint and add the "
                        "downstream block to its results.json")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    run_dir = os.path.join("runs", args.name)
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "train.log")
    try:
        if args.downstream_only:
            results = _finished_results(run_dir)
        else:
            data_path = build_data(args, log_path)
            seconds = train(args, data_path, run_dir, log_path)
            records = _records(run_dir)
            plot_loss(records, os.path.join(run_dir, "loss_curve.png"))
            results = summarize(records, seconds, args, run_dir)
            write_results(run_dir, results)  # training's results stand if scoring fails
        if args.downstream_limit > 0:
            results["downstream"] = score_downstream(args, run_dir, log_path)
            write_results(run_dir, results)
    except JobError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        ppl = ", ".join(f"{d} {v['ppl']:.1f}" for d, v in results["final_eval"].items())
        print(f"{results['steps']} steps in {results['train_wall_seconds']} s: train loss "
              f"{results['first_logged_loss']:.3f} -> {results['final_train_loss']:.3f}; "
              f"held-out perplexity {ppl}\nwrote {run_dir}/ (results.json, loss_curve.png, "
              "metrics.jsonl, config.yaml, train.log)")
        if "downstream" in results:
            print(downstream_lines(results["downstream"]))
    return 0


def _finished_results(run_dir: str) -> Dict:
    path = os.path.join(run_dir, "results.json")
    if not os.path.isfile(path):
        raise JobError(f"--downstream-only needs a finished run: {path} is missing. Fix: "
                       "run tools/run_main_job.py without --downstream-only first")
    with open(path) as fh:
        return json.load(fh)


if __name__ == "__main__":
    sys.exit(main())
