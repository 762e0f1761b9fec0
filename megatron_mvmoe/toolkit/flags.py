"""The flags and the parser every tool shares.

- `tool_parser`: the whole module docstring as --help, a wrong argument one line on stderr;
- `add_checkpoint_flags` / `run_from_flags` (tools/generate.py, tools/evaluate.py,
  lm-eval): which checkpoint, on which layout, with which tokenizer. Names are
  Megatron-LM's (`--load`, `--tensor-model-parallel-size`, `--tokenizer-type`, ...); unset
  flags keep the checkpoint's own run config;
- `add_heldout_args` / `parse_overrides` (the analyses that read a `--model`): held-out
  data, `--set section.field=value` run-config overrides and `--json`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict

from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
from megatron_mvmoe.config.run_config import RunConfig
from megatron_mvmoe.toolkit.checkpoint import checkpoint_run_config, with_layout


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse for the tools: a wrong argument is one line on stderr and exit status 2,
    never the usage dump (the line names the flag; --help has the rest)."""

    def error(self, message: str):
        fix = "" if "Fix:" in message else ". Fix: see --help"
        self.exit(2, f"error: {message}{fix}\n")


def tool_parser(doc: str) -> ToolArgumentParser:
    """The tools' parser: the whole module docstring as the description (--help)."""
    return ToolArgumentParser(description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)


def existing_path(what: str, kind: str = "file"):
    """An argparse `type` that refuses a path that is not an existing `kind` (file or dir),
    so the error names the flag (argparse prefixes it) and what to pass instead."""
    check = os.path.isfile if kind == "file" else os.path.isdir

    def parse(text: str) -> str:
        if not check(text):
            raise argparse.ArgumentTypeError(f"{text!r}: no such {kind}. Fix: pass {what}")
        return text
    return parse


# ------------------------------------------------------------ checkpoint, layout, tokenizer
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
    run.parallel.vpp = run.parallel.pp_layout = None  # a layout names the saved pp
    run.training.ckpt_allow_unverified = bool(getattr(args, "ckpt_allow_unverified", False))
    for name in _TOKENIZER:
        if getattr(args, name) is not None:
            setattr(run.data, name, getattr(args, name))
    return run


# ------------------------------------------------------------ held-out data, --set, --json
def add_heldout_args(parser) -> None:
    """The held-out data, override and output flags every model-reading tool shares."""
    parser.add_argument("--data-path", default=None,
                        help="held-out data dir (overrides the run's data.path); "
                             "none = random tokens")
    parser.add_argument("--data-kind", default=None, choices=["indexed", "tokens"])
    parser.add_argument("--batches", type=int, default=4, help="held-out batches per domain")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="run-config override, e.g. model.multi_view.gamma_ramp_steps=0 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def parse_overrides(pairs) -> Dict[str, Any]:
    """`--set section.field=value` pairs -> {"section.field": value} (value parsed as YAML)."""
    import yaml

    out: Dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {pair!r}: expected section.field=value, e.g. "
                             "model.multi_view.gamma_ramp_steps=0")
        out[key.strip()] = yaml.safe_load(value)
    return out


def heldout_overrides(args) -> Dict[str, Any]:
    """The run-config overrides of `add_heldout_args`' flags (data, then every --set)."""
    overrides = {key: value for key, value in (("data.path", args.data_path),
                                               ("data.kind", args.data_kind)) if value}
    overrides.update(parse_overrides(args.set))
    return overrides
