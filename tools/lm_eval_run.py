#!/usr/bin/env python
"""Run lm-eval (EleutherAI lm-evaluation-harness) on a trained checkpoint, offline.

Builds the local multiple-choice task `mvmoe_continuation` from held-out text (a JSONL with
a "text" field, or a text file): for each paragraph, pick its true next words among
--num-choices continuations (megatron_mvmoe/evaluation/lm_eval_task.py), then evaluates the
checkpoint with our lm-eval model class (megatron_mvmoe/evaluation/lm_eval_model.py) through
`lm_eval.simple_evaluate`. Other lm-eval tasks work too (--tasks) when their data is local.

Examples:
    python tools/lm_eval_run.py --load runs/main_job/checkpoints \\
        --task-source data/corpus/books.valid.jsonl --num-docs 100 --json
    torchrun --nproc-per-node 2 tools/lm_eval_run.py --load ck --expert-model-parallel-size 2 \\
        --task-source held_out.jsonl
"""

from __future__ import annotations

import argparse
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
                   help="lm-eval task names (default: mvmoe_continuation)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (lm-eval)")
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
        from lm_eval.tasks import TaskManager
    except ImportError:
        say("error: lm-eval is not installed. Fix: pip install -e .[eval]")
        return 2
    from megatron_mvmoe.evaluation.lm_eval_model import MVMoELM
    from megatron_mvmoe.evaluation.lm_eval_task import TASK_NAME, make_docs, read_texts, write_task
    from megatron_mvmoe.checkpointing.errors import CheckpointError

    start = time.time()
    try:
        task_dir = args.task_dir or tempfile.mkdtemp(prefix="mvmoe_lm_eval_")
        if args.task_source:
            docs = make_docs(read_texts(args.task_source), args.num_docs, args.num_choices,
                             args.context_words, args.choice_words)
            write_task(docs, task_dir)
            say(f"task {TASK_NAME}: {len(docs)} documents, {args.num_choices} choices -> "
                f"{task_dir}")
        model = MVMoELM(load=args.load, tp=args.tp, ep=args.ep)
        try:
            results = lm_eval.simple_evaluate(
                model=model, tasks=args.tasks or [TASK_NAME], num_fewshot=0,
                task_manager=TaskManager(include_path=task_dir), limit=args.limit,
                log_samples=False)
        finally:
            model.close()
    except (ValueError, CheckpointError) as err:
        say(f"error: {err}")
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    summary = {task: {k.split(",")[0]: v for k, v in metrics.items()
                      if isinstance(v, (int, float)) and not k.startswith("alias")}
               for task, metrics in results["results"].items()}
    out = {"checkpoint": args.load, "seconds": round(time.time() - start, 1),
           "results": summary, "n_samples": results.get("n-samples")}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for task, metrics in summary.items():
            print(task, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
