#!/usr/bin/env python
"""Run lm-eval (EleutherAI lm-evaluation-harness) on a trained checkpoint, offline.

Builds the local multiple-choice task `mvmoe_continuation` from held-out text (a JSONL with
a "text" field, or a text file): for each paragraph, pick its true next words among
--num-choices continuations (megatron_mvmoe/evaluation/lm_eval_task.py), then evaluates the
checkpoint with our lm-eval model class (megatron_mvmoe/evaluation/lm_eval_model.py) through
`lm_eval.simple_evaluate`.

--tasks standard (or any of arc_easy arc_challenge hellaswag piqa winogrande boolq openbookqa
social_iqa lambada_openai mmlu, or an mmlu_<subject>) runs lm-eval's own task definitions on the
local files tools/fetch_benchmarks.py wrote (scripts/setup_env.sh runs it): lm-eval's prompts,
metrics and normalisation, only the data source changed (evaluation/benchmark_tasks.py). It
prints a table (task, split, items, metric, score, standard error, chance level) and the macro
mean of the tasks' scores (acc_norm for ARC, HellaSwag, PIQA, OpenBookQA; acc elsewhere;
mmlu is one task, its 57 subjects weighted by size as lm-eval does). A task whose files are
missing is refused in one line naming it and the fix. Other lm-eval task names pass through
to lm-eval unchanged (they need their data reachable: unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE).
The tokenizer is the run's: its data.path's tokenizer/, read relative to the directory the
tool runs in when the path is relative (the main job's is), or --tokenizer-type with
--tokenizer-model / --vocab-file --merge-file; a run whose tokenizer is not found is refused
naming where it looked (test_a_run_without_its_tokenizer_here_names_a_fix_the_tool_takes).
Checked by tests/hf/test_downstream.py.

Examples:
    python tools/lm_eval_run.py --load runs/main_job/checkpoints \\
        --task-source data/corpus/books.valid.jsonl --num-docs 100 --json
    torchrun --nproc-per-node 2 tools/lm_eval_run.py --load ck --expert-model-parallel-size 2 \\
        --task-source held_out.jsonl
    python tools/lm_eval_run.py --load runs/main_job/checkpoints --tasks standard --limit 50
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from megatron_mvmoe.toolkit.flags import existing_path, tool_parser

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task data is local; never the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    p.add_argument("--load", required=True, help="checkpoint root or iter_* directory")
    p.add_argument("--expert-model-parallel-size", dest="ep", type=int, default=1,
                   help="EP size to load onto (run under torchrun with that many ranks)")
    p.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="TP size to load onto")
    for flag, what in (("--tokenizer-type", "override the run's tokenizer: GPT2BPETokenizer, "
                        "HuggingFaceTokenizer, NullTokenizer or Llama2Tokenizer"),
                       ("--tokenizer-model", "HuggingFaceTokenizer tokenizer.json or its "
                        "directory; Llama2Tokenizer .model"),
                       ("--vocab-file", "GPT2BPETokenizer vocab.json"),
                       ("--merge-file", "GPT2BPETokenizer merges.txt")):
        p.add_argument(flag, default=None, help=what)
    p.add_argument("--task-source", type=existing_path(
                       "a held-out JSONL ('text' field) or text file"), help="held-out JSONL ('text' field) or text file to "
                   "build the mvmoe_continuation task from")
    p.add_argument("--task-dir", default=None,
                   help="where the task YAML and docs go (default: a temporary directory)")
    p.add_argument("--num-docs", type=int, default=100, help="task documents (default 100)")
    p.add_argument("--num-choices", type=int, default=4, help="choices per document")
    p.add_argument("--context-words", type=int, default=16, help="words of context")
    p.add_argument("--choice-words", type=int, default=6, help="words per choice")
    p.add_argument("--tasks", nargs="+", default=None,
                   help="lm-eval task names, or 'standard' for the ten local benchmarks "
                        "(default: mvmoe_continuation)")
    p.add_argument("--limit", type=int, default=None,
                   help="documents per task (lm-eval's first N; for mmlu: per subject)")
    p.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples (default 0)")
    p.add_argument("--benchmark-dir", default=None,
                   help="the local benchmark files (default: $MVMOE_BENCHMARK_DIR or "
                        "data/benchmarks, as tools/fetch_benchmarks.py writes them)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    if args.tasks is None and args.task_source is None:
        p.error("give --task-source to build mvmoe_continuation, or --tasks")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        import lm_eval
    except ImportError:
        say("error: lm-eval is not installed. Fix: pip install -e .[eval]")
        return 2
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.evaluation import benchmark_tasks
    from megatron_mvmoe.evaluation.lm_eval_model import MVMoELM
    from megatron_mvmoe.evaluation.lm_eval_task import TASK_NAME, make_docs, read_texts, write_task

    start = time.time()
    tasks = benchmark_tasks.expand(args.tasks or [TASK_NAME])
    try:
        benchmark_tasks.check_local(tasks, args.benchmark_dir or default_root())
        task_dir = args.task_dir or tempfile.mkdtemp(prefix="mvmoe_lm_eval_")
        if args.task_source:
            docs = make_docs(read_texts(args.task_source), args.num_docs, args.num_choices,
                             args.context_words, args.choice_words)
            write_task(docs, task_dir)
            say(f"task {TASK_NAME}: {len(docs)} documents, {args.num_choices} choices -> "
                f"{task_dir}")
        manager = benchmark_tasks.task_manager(task_dir, tasks, args.benchmark_dir)
        model = MVMoELM(load=args.load, tp=args.tp, ep=args.ep,
                        tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                        merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
        try:  # lm-eval prints to stdout ("bootstrapping for stddev"): stdout stays the result
            with contextlib.redirect_stdout(sys.stderr):
                results = lm_eval.simple_evaluate(
                    model=model, tasks=tasks, num_fewshot=args.num_fewshot,
                    task_manager=manager, limit=args.limit, log_samples=False)
        finally:
            model.close()
    except (ValueError, CheckpointError) as err:
        say(f"error: {err}")
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    out = summarise(results, tasks, args)
    out["seconds"] = round(time.time() - start, 1)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(benchmark_tasks.score_table(out))
    return 0


def default_root() -> str:
    from megatron_mvmoe.evaluation.benchmark_data import default_root as root

    return root()


def summarise(results: dict, tasks, args) -> dict:
    """Per requested task: every metric lm-eval reports (and its stderr), the primary score,
    its stderr, the evaluated split, items and chance level; the macro mean of the scores."""
    from megatron_mvmoe.evaluation import benchmark_tasks

    summary, rows = {}, {}
    for task, metrics in results["results"].items():
        summary[task] = {k.split(",")[0]: v for k, v in metrics.items()
                         if isinstance(v, (int, float)) and not k.startswith("alias")}
    for task in tasks:
        metrics = summary.get(task, {})
        metric = benchmark_tasks.primary_metric(task, metrics)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        if n is None and benchmark_tasks.leaves(task):  # a group: its subjects' items
            n = sum(results.get("n-samples", {}).get(leaf, {}).get("effective", 0)
                    for leaf in benchmark_tasks.leaves(task))
        rows[task] = {"metric": metric, "score": metrics.get(metric),
                      "stderr": metrics.get(f"{metric}_stderr"), "items": n,
                      "split": benchmark_tasks.eval_split(task),
                      "chance": benchmark_tasks.chance(task, args.benchmark_dir)
                      if benchmark_tasks.is_local(task) else None}
    scores = [r["score"] for r in rows.values() if r["score"] is not None]
    return {"checkpoint": args.load, "tasks": rows, "results": summary,
            "mean": sum(scores) / len(scores) if scores else None,
            "num_fewshot": args.num_fewshot, "limit": args.limit,
            "n_samples": results.get("n-samples")}


if __name__ == "__main__":
    sys.exit(main())
