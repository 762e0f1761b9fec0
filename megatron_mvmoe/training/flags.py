"""Megatron-style command-line flags that override single RunConfig fields.

Design choices:
- One table maps each flag to (section, field, type); the argparse parser and the
  override step are both generated from it, so a flag cannot exist without a field.
- Flag names follow Megatron-LM's (`--tensor-model-parallel-size`, `--train-iters`, ...)
  so recipes port over; an unset flag (None) leaves the YAML/preset value alone.
"""

from __future__ import annotations

import argparse
from typing import Callable, List, NamedTuple, Optional, Sequence

from megatron_mvmoe.training.config import RunConfig, config_from_dict, load_yaml


class Flag(NamedTuple):
    name: str
    section: str
    field: str
    type: Callable
    help: str


def _bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


FLAGS: List[Flag] = [
    Flag("--tensor-model-parallel-size", "parallel", "tp", int, "TP size"),
    Flag("--pipeline-model-parallel-size", "parallel", "pp", int, "PP stages"),
    Flag("--expert-model-parallel-size", "parallel", "ep", int, "EP size"),
    Flag("--expert-tensor-parallel-size", "parallel", "etp", int, "expert TP size"),
    Flag("--virtual-pipeline-model-parallel-size", "parallel", "vpp", int, "VPP chunks"),
    Flag("--distributed-timeout-seconds", "parallel", "distributed_timeout_seconds", float,
         "collective timeout (a dead rank fails the job after this)"),
    Flag("--model-preset", "model", "preset", str, "preset name (models/presets.py)"),
    Flag("--moe-variant", "model", "moe_variant", str, "dense|smoe|latent|multi_router|"
         "multi_view|mh_moe"),
    Flag("--num-layers", "model", "num_layers", int, "transformer layers"),
    Flag("--hidden-size", "model", "hidden_size", int, "D"),
    Flag("--num-attention-heads", "model", "num_attention_heads", int, "attention heads"),
    Flag("--ffn-hidden-size", "model", "ffn_hidden_size", int, "dense MLP width"),
    Flag("--num-experts", "model", "num_experts", int, "E"),
    Flag("--moe-ffn-hidden-size", "model", "moe_ffn_hidden_size", int, "expert width"),
    Flag("--moe-router-topk", "model", "moe_router_topk", int, "top-k"),
    Flag("--moe-shared-expert-intermediate-size", "model",
         "moe_shared_expert_intermediate_size", int, "shared expert width"),
    Flag("--latent-size", "model", "latent_size", int, "L"),
    Flag("--num-routers", "model", "num_routers", int, "R routing heads"),
    Flag("--num-views", "model", "num_views", int, "K views"),
    Flag("--gamma-ramp-steps", "model", "gamma_ramp_steps", int, "gamma 0->1 ramp length"),
    Flag("--vocab-size", "model", "vocab_size", int, "padded vocabulary size"),
    Flag("--seq-length", "model", "seq_length", int, "sequence length"),
    Flag("--lr", "optimizer", "lr", float, "peak learning rate"),
    Flag("--min-lr", "optimizer", "min_lr", float, "cosine floor"),
    Flag("--lr-warmup-iters", "optimizer", "warmup_iters", int, "warmup steps"),
    Flag("--lr-decay-iters", "optimizer", "decay_iters", int, "cosine decay steps"),
    Flag("--weight-decay", "optimizer", "weight_decay", float, "weight decay"),
    Flag("--clip-grad", "optimizer", "clip_grad", float, "grad-norm clip"),
    Flag("--use-distributed-optimizer", "optimizer", "use_distributed_optimizer", _bool,
         "true/false"),
    Flag("--data-kind", "data", "kind", str, "indexed|tokens"),
    Flag("--data-path", "data", "path", str, "preprocessed data directory"),
    Flag("--train-iters", "training", "train_iters", int, "optimizer steps"),
    Flag("--global-batch-size", "training", "global_batch_size", int, "sequences per step"),
    Flag("--micro-batch-size", "training", "micro_batch_size", int, "sequences per microbatch"),
    Flag("--eval-interval", "training", "eval_interval", int, "steps between evaluations"),
    Flag("--eval-iters", "training", "eval_iters", int, "global batches per domain per evaluation"),
    Flag("--save", "training", "save", str, "checkpoint root"),
    Flag("--load", "training", "load", str, "checkpoint root to resume from"),
    Flag("--load-optimizer", "training", "load_optimizer", _bool, "true/false"),
    Flag("--ckpt-optimizer-format", "training", "ckpt_optimizer_format", str,
         "dp_reshardable|fully_reshardable"),
    Flag("--save-interval", "training", "save_interval", int, "steps between saves"),
    Flag("--seed", "training", "seed", int, "random seed"),
    Flag("--precision", "training", "precision", str, "auto|bf16|fp32"),
    Flag("--log-interval", "logging", "log_interval", int, "steps between progress lines"),
    Flag("--run-dir", "logging", "run_dir", str, "directory for logs and config"),
    Flag("--tensorboard", "logging", "tensorboard", _bool, "true/false"),
]


def build_parser(description: str = "megatron_mvmoe pretraining") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="run config YAML (examples/*.yaml); flags override it")
    for flag in FLAGS:
        parser.add_argument(flag.name, type=flag.type, default=None, help=flag.help)
    return parser


def apply_flags(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """Set every flag given on the command line on its RunConfig field (in place).
    An empty string clears an optional field (e.g. --save "" turns saving off)."""
    for flag in FLAGS:
        value = getattr(args, flag.name.lstrip("-").replace("-", "_"))
        if value is not None:
            setattr(getattr(config, flag.section), flag.field, None if value == "" else value)
    return config


def config_from_args(argv: Optional[Sequence[str]] = None,
                     parser: Optional[argparse.ArgumentParser] = None) -> RunConfig:
    """YAML (if --config) then flag overrides, validated field by field."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    config = load_yaml(args.config) if args.config else config_from_dict({})
    apply_flags(config, args)
    config.validate()
    return config
