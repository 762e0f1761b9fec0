#!/usr/bin/env python
"""Evaluate a trained checkpoint: held-out loss and perplexity per data component.

With no data flags it evaluates on the checkpoint's own validation data with the trainer's
own evaluation (same samples, same reduction), so the numbers equal the trainer's eval line
at that step. Data flags evaluate it elsewhere: Megatron-LM prefixes (--data-path with
--split, or --valid-data-path, each prefix its own component), our preprocessed directory
(--data-path DIR), or raw JSONL files (--input-jsonl, tokenized with the run's tokenizer;
each file is a component). Run under torchrun for EP > 1.

Examples:
    python tools/evaluate.py --load runs/main_job/checkpoints --json
    python tools/evaluate.py --load ck --valid-data-path data/a_text_document data/b_text_document
    python tools/evaluate.py --load ck --input-jsonl held_out/books.jsonl --eval-iters 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron_mvmoe.toolkit.flags import (add_checkpoint_flags, existing_path,  # noqa: E402
                                          run_from_flags, tool_parser)


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    add_checkpoint_flags(p)
    d = p.add_argument_group("data (default: the checkpoint's own validation data)")
    d.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron-LM prefixes or weight prefix pairs (evaluated on their "
                   "--split validation part), or our preprocessed directory")
    d.add_argument("--split", default=None, help="train,valid,test weights for --data-path")
    d.add_argument("--valid-data-path", nargs="+", default=None,
                   help="prefixes evaluated whole (each prefix one component)")
    d.add_argument("--input-jsonl", nargs="+", default=None, type=existing_path(
                       "an existing JSONL file ({\"text\": ...} per line)"),
                   help="JSONL files ({\"text\": ...} per line), one component each")
    d.add_argument("--json-key", default="text", help="JSONL field to read (default text)")
    d.add_argument("--data-cache-path", default=None, help="GPTDataset index cache directory")
    p.add_argument("--eval-iters", type=int, default=None,
                   help="global batches per component (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def _jsonl_prefixes(run, paths, key, say):
    from megatron_mvmoe.data.jsonl import TokenizerSpec, preprocess_jsonl

    d = run.data
    if d.tokenizer_type is not None:
        spec = TokenizerSpec(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                             d.null_vocab_size)
    else:
        spec = TokenizerSpec("HuggingFaceTokenizer",
                             tokenizer_model=os.path.join(str(d.path), "tokenizer"))
        d.tokenizer_type, d.tokenizer_model = spec.tokenizer_type, spec.tokenizer_model
    out_dir = tempfile.mkdtemp(prefix="mvmoe_eval_")
    prefixes = []
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        result = preprocess_jsonl(path, [key], os.path.join(out_dir, stem), spec,
                                  append_eod=True, progress=say)
        prefixes.append(result["outputs"][key]["prefix"])
    return prefixes


def apply_data_flags(run, args, say) -> None:
    d = run.data
    if args.data_cache_path:
        d.cache_path = args.data_cache_path
    given = [x for x in (args.data_path, args.valid_data_path, args.input_jsonl) if x]
    if len(given) > 1:
        raise ValueError("data: give one of --data-path, --valid-data-path, --input-jsonl. "
                         "Fix: keep one")
    if not given:
        return
    d.mock, d.train_path, d.test_path, d.valid_path, d.eval_domains = False, [], [], [], []
    if args.data_path:
        d.path = args.data_path[0] if len(args.data_path) == 1 and os.path.isdir(
            args.data_path[0]) else list(args.data_path)
        d.split = args.split
        return
    valid = args.valid_data_path or _jsonl_prefixes(run, args.input_jsonl, args.json_key, say)
    d.path, d.split = None, None
    d.train_path, d.valid_path = list(valid), list(valid)  # train set unused, but required


def main(argv=None) -> int:
    import torch.distributed as dist

    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.data.run_data import RunData
    from megatron_mvmoe.toolkit.checkpoint import load_model, tool_session
    from megatron_mvmoe.training.step import evaluate

    args = parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        run = run_from_flags(args)
        apply_data_flags(run, args, say)
        if args.eval_iters is not None:
            run.training.eval_iters = args.eval_iters
        with tool_session(run) as pgs:
            start = time.time()
            loaded = load_model(run, args.load, pgs)
            model = loaded.model_section
            data = RunData(run, model.seq_length, model.vocab_size, pgs.dp.rank(), pgs.dp.size())
            if dist.get_rank() == 0:
                say(f"evaluating step {loaded.step} on "
                    f"{list(data.valid)}, {run.training.eval_iters} global batches each")
            microbatches = run.training.eval_iters * run.num_microbatches(dist.get_world_size())
            losses = evaluate(loaded, data, microbatches, pgs)
            rank = dist.get_rank()
    except (ValueError, CheckpointError) as err:
        say(f"error: {err}")
        return 2
    if rank != 0:
        return 0
    tokens = run.training.eval_iters * run.training.global_batch_size \
        * loaded.model_section.seq_length
    result = {"checkpoint": args.load, "step": loaded.step,
              "seconds": round(time.time() - start, 2),
              "tokens_per_component": tokens,
              "components": {name: {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
                             for name, loss in losses.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, value in result["components"].items():
            print(f"{name:32s} loss {value['loss']:.4f} ppl {value['ppl']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
