"""Flags shared by the checkpoint tools (tools/generate.py, tools/evaluate.py,
tools/lm_eval_model.py): which checkpoint, on which layout, with which tokenizer.

Names are Megatron-LM's (`--load`, `--tensor-model-parallel-size`, `--tokenizer-type`, ...);
unset flags keep the checkpoint's own run config.
"""

from __future__ import annotations

import argparse

from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
from megatron_mvmoe.config.run_config import RunConfig
from megatron_mvmoe.training.from_checkpoint import checkpoint_run_config, with_layout

_LAYOUT = (("--tensor-model-parallel-size", "tp"), ("--pipeline-model-parallel-size", "pp"),
           ("--expert-model-parallel-size", "ep"), ("--expert-tensor-parallel-size", "etp"))
_TOKENIZER = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
# A tool reads a trained model: there is no fresh start to fall back to.
TOOL_LOAD_FIX = ("pass a checkpoint written by the trainer: its --save root (e.g. "
                 "runs/main_job/checkpoints) or one of its iter_* directories")


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoint, layout and tokenizer")
    group.add_argument("--load", required=True,
                       help="checkpoint root (its `latest`) or an iter_* directory written "
                       "by the trainer; its run config gives the model and the tokenizer")
    for flag, field in _LAYOUT:
        group.add_argument(flag, dest=field, type=int, default=None,
                           help=f"{field.upper()} size to load onto (default 1; the checkpoint "
                           "reshards to any layout)")
    group.add_argument("--tokenizer-type", default=None,
                       help="override the run's tokenizer: GPT2BPETokenizer, "
                       "HuggingFaceTokenizer, NullTokenizer or Llama2Tokenizer")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument("--ckpt-allow-unverified", action="store_true",
                       help="load a checkpoint without manifest.json (bytes unverified)")
    group.add_argument("--tokenizer-model", default=None,
                       help="HuggingFaceTokenizer tokenizer.json or its directory; "
                       "Llama2Tokenizer .model")


def run_from_flags(args: argparse.Namespace) -> RunConfig:
    """The checkpoint's run config on the layout and tokenizer the flags ask for."""
    resolve_checkpoint(args.load, missing_fix=TOOL_LOAD_FIX)  # the tool's fix, not resume's
    run = checkpoint_run_config(args.load)
    layout = {field: getattr(args, field) for _, field in _LAYOUT}
    run = with_layout(run, {k: (1 if v is None else v) for k, v in layout.items()})
    run.parallel.vpp = None
    run.training.ckpt_allow_unverified = bool(getattr(args, "ckpt_allow_unverified", False))
    for name in _TOKENIZER:
        if getattr(args, name) is not None:
            setattr(run.data, name, getattr(args, name))
    return run
