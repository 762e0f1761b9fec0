"""Tiny trained checkpoints for the HF tests: the real trainer, 3 steps on the Python-docs
prefix of tests/training/textdata.py (512-token BPE as a tokenizer.json), saved at the end.
Held-out text is the Jargon File, never trained on."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

from harness import train
from textdata import build_megatron_prefixes

from megatron_mvmoe.config.flags import config_from_args  # noqa: E402

SIGMOID_SHARED = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-shared-expert-intermediate-size", "128", "--moe-aux-loss-coeff", "0",
                  "--moe-router-load-balancing-type", "none"]


def prefixes(out_dir: str) -> Dict:
    return build_megatron_prefixes(out_dir)


def train_checkpoint(root: str, data: Dict, preset: str, flags: Sequence[str] = (),
                     world: int = 1, iters: int = 3, timeout_s: float = 240,
                     extra: Optional[Dict] = None) -> str:
    """Train `preset` for `iters` steps on `world` gloo ranks and save to `root`
    (`extra`: model.extra fields no flag sets, e.g. moe_shared_expert_gate)."""
    run = config_from_args([
        "--model-preset", preset, "--seq-length", "32", "--train-iters", str(iters),
        "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-iters", "0",
        "--eval-interval", "0", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1",
        "--gamma-ramp-steps", "4", "--tensorboard", "false", "--save", root,
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["tokenizer"],
        "--data-path", data["tech"], "--split", "90,10,0", *flags])
    run.model.vocab_size = None
    run.model.extra.update(extra or {})
    train(run.to_dict(), world, timeout_s=timeout_s)
    return root


def held_out_ids(data: Dict, count: int = 32) -> List[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(data["tokenizer"])
    with open(data["jsonl"]["reference"]) as fh:
        text = " ".join(json.loads(line)["text"] for _, line in zip(range(5), fh))
    return tok.encode(text, add_special_tokens=False).ids[:count]


def export_and_run_ours(rank, world_size, root: str, out: str, hf_class: str,
                        ids: List[int], new_tokens: int):
    """On one rank: export, then our model's logits [S, V] on `ids` and greedy tokens after
    ids[:8] with the generation code tools/generate.py runs (the checkpoint resharded to one
    rank, as tools/generate.py --load does without layout flags on one process)."""
    from megatron_mvmoe.hf.export import export_checkpoint
    from megatron_mvmoe.toolkit.checkpoint import (checkpoint_run_config, load_model,
                                                   tool_session, with_layout)
    from megatron_mvmoe.toolkit.generation import SamplingConfig, generate, sequence_logits

    summary = export_checkpoint(root, out, hf_class)
    run = with_layout(checkpoint_run_config(root), dict(tp=1, pp=1, ep=1, etp=1))
    with tool_session(run) as pgs:
        model = load_model(run, root, pgs).model[0]
        logits = sequence_logits(model, ids)
        tokens = generate(model, ids[:8], SamplingConfig(max_new_tokens=new_tokens,
                                                         stop_at_eod=False),
                          run.model.seq_length, 512)
    return summary, logits, tokens


def hf_logits_and_tokens(out: str, ids: List[int], new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                 dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        model.generation_config.eos_token_id = None  # as --no-stop-at-eod
        generated = model.generate(torch.tensor([ids[:8]]), max_new_tokens=new_tokens,
                                   do_sample=False)
    return model, logits, generated[0, 8:].tolist()
