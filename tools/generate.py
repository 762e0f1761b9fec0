#!/usr/bin/env python
"""Generate text from a trained checkpoint: greedy or top-p sampling, any MoE variant, any
TP/EP layout the checkpoint reshards to (run under torchrun for EP > 1).

The model and the tokenizer come from the checkpoint's run config; each prompt is
continued by --max-new-tokens tokens (stopping at end-of-document unless --no-stop-at-eod).

Examples:
    python tools/generate.py --load runs/main_job/checkpoints --prompt "The meaning of"
    torchrun --nproc-per-node 2 tools/generate.py --load runs/main_job/checkpoints \\
        --expert-model-parallel-size 2 --top-p 0.9 --temperature 0.8 --prompt "def " --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron_mvmoe.toolkit.flags import (add_checkpoint_flags, run_from_flags,  # noqa: E402
                                          tool_parser)


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    add_checkpoint_flags(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="text to continue; repeat the flag for several prompts")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens to generate per prompt (default 32)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens with this much probability "
                   "(nucleus sampling); without it decoding is greedy")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divide the logits by this before top-p sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    p.add_argument("--no-stop-at-eod", action="store_true",
                   help="keep generating past the end-of-document token")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch.distributed as dist

    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.toolkit.checkpoint import load_model, run_tokenizer, tool_session
    from megatron_mvmoe.toolkit.generation import SamplingConfig, generate

    args = parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=args.top_p is None,
                                  top_p=args.top_p or 1.0, temperature=args.temperature,
                                  seed=args.seed, stop_at_eod=not args.no_stop_at_eod)
        run = run_from_flags(args)
        outputs = []
        with tool_session(run) as pgs:
            is_main = dist.get_rank() == 0
            progress = say if is_main else None
            start = time.time()
            loaded = load_model(run, args.load, pgs)
            tokenizer = run_tokenizer(run)
            if is_main:
                say(f"loaded {args.load} ({loaded.model_section.moe_variant}, layout tp="
                    f"{run.parallel.tp} ep={run.parallel.ep}) in {time.time() - start:.1f} s")
            model = loaded.model[0]
            for prompt in args.prompt:
                ids = generate(model, tokenizer.tokenize(prompt), sampling,
                               loaded.model_section.seq_length, tokenizer.vocab_size,
                               eod_id=tokenizer.eod, progress=progress)
                outputs.append({"prompt": prompt, "text": tokenizer.detokenize(ids),
                                "tokens": ids})
    except (ValueError, CheckpointError) as err:
        say(f"error: {err}")
        return 2
    if not is_main:
        return 0
    if args.json:
        print(json.dumps({"checkpoint": args.load, "greedy": sampling.greedy,
                          "top_p": args.top_p, "outputs": outputs}, indent=2))
    else:
        for out in outputs:
            print(f"{out['prompt']}{out['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
