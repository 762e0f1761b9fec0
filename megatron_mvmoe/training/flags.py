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
    # --- parallel layout
    Flag("--tensor-model-parallel-size", "parallel", "tp", int,
         "TP size (MoE with TP > 1 turns sequence parallelism on; needs EP > 1 or ETP = TP)"),
    Flag("--pipeline-model-parallel-size", "parallel", "pp", int, "pipeline stages"),
    Flag("--expert-model-parallel-size", "parallel", "ep", int, "expert-parallel size"),
    Flag("--expert-tensor-parallel-size", "parallel", "etp", int,
         "expert tensor-parallel size (gloo needs 1 with TP > 1)"),
    Flag("--virtual-pipeline-model-parallel-size", "parallel", "vpp", int,
         "virtual pipeline chunks per rank (interleaved 1F1B)"),
    Flag("--distributed-timeout-seconds", "parallel", "distributed_timeout_seconds", float,
         "collective timeout (a dead rank fails the job after this)"),
    # --- model shape (None keeps the preset's value)
    Flag("--model-preset", "model", "preset", str,
         "preset name in megatron_mvmoe/models/presets.py, e.g. tiny_multi_view"),
    Flag("--moe-variant", "model", "moe_variant", str,
         "dense|smoe|latent|multi_router|multi_view|mh_moe"),
    Flag("--num-layers", "model", "num_layers", int, "transformer layers"),
    Flag("--hidden-size", "model", "hidden_size", int, "D, the hidden size"),
    Flag("--num-attention-heads", "model", "num_attention_heads", int, "attention heads"),
    Flag("--num-query-groups", "model", "num_query_groups", int,
         "grouped-query attention KV groups"),
    Flag("--ffn-hidden-size", "model", "ffn_hidden_size", int, "dense MLP width"),
    Flag("--num-experts", "model", "num_experts", int, "E, routed experts per MoE layer"),
    Flag("--moe-ffn-hidden-size", "model", "moe_ffn_hidden_size", int, "routed expert width"),
    Flag("--moe-router-topk", "model", "moe_router_topk", int, "experts per token (top-k)"),
    Flag("--moe-shared-expert-intermediate-size", "model",
         "moe_shared_expert_intermediate_size", int, "shared expert width"),
    Flag("--latent-size", "model", "latent_size", int,
         "L, latent size of latent / multi_router / multi_view"),
    Flag("--num-routers", "model", "num_routers", int, "R routing heads"),
    Flag("--num-views", "model", "num_views", int, "K latent views (multi_view: = R)"),
    Flag("--gamma-ramp-steps", "model", "gamma_ramp_steps", int,
         "steps over which the view perturbation gamma ramps 0 -> 1 (0 = gamma 1 at once)"),
    Flag("--num-heads-mh", "model", "num_heads_mh", int, "H sub-tokens per token (mh_moe)"),
    Flag("--vocab-size", "model", "vocab_size", int, "padded vocabulary size"),
    Flag("--seq-length", "model", "seq_length", int, "sequence length"),
    # --- Multi-View / BitNet switches
    Flag("--stop-grad-mixing", "model", "stop_grad_mixing", _bool,
         "detach the Multi-View mixing weights (the paper's ablation); bare flag = true"),
    Flag("--gate-scale", "model", "gate_scale", float,
         "alpha, the scale on the normalised gates (Eq. 3; default 1.0)"),
    Flag("--learned-gate-scale", "model", "learned_gate_scale", _bool,
         "learn alpha per expert, initialised to --gate-scale; bare flag = true"),
    Flag("--multi-view-kernels", "model", "multi_view_kernels", str,
         "auto|triton|reference: Multi-View mix-and-permute backend (auto = Triton on "
         "CUDA, torch elsewhere; triton on CPU only under TRITON_INTERPRET=1)"),
    Flag("--bitnet", "model", "bitnet", _bool,
         "BitNet b1.58 quantization-aware training (ternary weights, int8 activations); "
         "bare flag = true"),
    # --- router trace (Megatron-LM's names)
    Flag("--moe-routing-trace-path", "logging", "moe_routing_trace_path", str,
         "write Megatron's router trace (router_trace_rank<N>.jsonl, every MoE layer's "
         "top-k per step, MultiRouter included) to this directory"),
    Flag("--moe-routing-trace-max-iters", "logging", "moe_routing_trace_max_iters", int,
         "steps to trace (default 100)"),
    Flag("--moe-routing-trace-capture-logits", "logging", "moe_routing_trace_capture_logits",
         _bool, "also capture pre-top-k logits as bf16 sidecars; bare flag = true"),
    # --- optimizer
    Flag("--lr", "optimizer", "lr", float, "peak learning rate"),
    Flag("--min-lr", "optimizer", "min_lr", float, "floor of the cosine decay"),
    Flag("--lr-warmup-iters", "optimizer", "warmup_iters", int, "linear warmup steps"),
    Flag("--lr-decay-iters", "optimizer", "decay_iters", int,
         "cosine decay steps (default --train-iters)"),
    Flag("--weight-decay", "optimizer", "weight_decay", float, "weight decay"),
    Flag("--clip-grad", "optimizer", "clip_grad", float, "global grad-norm clip (0 = off)"),
    Flag("--adam-beta1", "optimizer", "adam_beta1", float, "Adam beta1"),
    Flag("--adam-beta2", "optimizer", "adam_beta2", float, "Adam beta2"),
    Flag("--adam-eps", "optimizer", "adam_eps", float, "Adam epsilon"),
    Flag("--use-distributed-optimizer", "optimizer", "use_distributed_optimizer", _bool,
         "shard optimizer states over data-parallel ranks (ZeRO-1); true/false"),
    # --- data
    Flag("--data-kind", "data", "kind", str,
         "indexed (Megatron .bin/.idx) | tokens (<domain>_<split>.npy)"),
    Flag("--data-path", "data", "path", str, "preprocessed data directory"),
    # --- training
    Flag("--train-iters", "training", "train_iters", int,
         "optimizer steps (0 = only evaluate/save the initial model)"),
    Flag("--global-batch-size", "training", "global_batch_size", int, "sequences per step"),
    Flag("--micro-batch-size", "training", "micro_batch_size", int, "sequences per microbatch"),
    Flag("--eval-interval", "training", "eval_interval", int,
         "steps between evaluations (0 = only at the end)"),
    Flag("--eval-iters", "training", "eval_iters", int, "global batches per domain per evaluation"),
    Flag("--save", "training", "save", str, "checkpoint root (\"\" = no saving)"),
    Flag("--load", "training", "load", str, "checkpoint root (or iter_* dir) to resume from"),
    Flag("--load-optimizer", "training", "load_optimizer", _bool,
         "with --load also restore optimizer, scheduler, step and data position; true/false"),
    Flag("--override-opt-param-scheduler", "training", "override_opt_param_scheduler", _bool,
         "on resume use this run's LR/WD schedule (lr, min-lr, warmup, decay length) at the "
         "checkpoint's step"),
    Flag("--use-checkpoint-opt-param-scheduler", "training",
         "use_checkpoint_opt_param_scheduler", _bool,
         "on resume keep the checkpoint's LR/WD schedule (the default; warns when this run's "
         "differs)"),
    Flag("--ckpt-optimizer-format", "training", "ckpt_optimizer_format", str,
         "dp_reshardable|fully_reshardable"),
    Flag("--save-interval", "training", "save_interval", int,
         "steps between saves (0 = only at the end)"),
    Flag("--warm-start-from", "training", "warm_start_from", str,
         "latent-MoE baseline checkpoint (root or iter_* dir) whose weights initialise this "
         "multi_view/multi_router model; optimizer and step start fresh, gamma ramp restarts; "
         "skipped when --load holds a checkpoint"),
    Flag("--warm-start-new-heads", "training", "warm_start_new_heads", str,
         "fresh|copy: routing heads 1..R-1 of a warm start keep their own init (fresh) or "
         "copy the baseline head (copy: the first forward equals the baseline's)"),
    Flag("--seed", "training", "seed", int, "random seed"),
    Flag("--precision", "training", "precision", str, "auto (bf16 on GPU, fp32 on CPU)|bf16|fp32"),
    Flag("--exit-on-nonfinite", "training", "exit_on_nonfinite", _bool,
         "stop with an error naming the step on a NaN/inf loss; true/false"),
    # --- fault tolerance (NaN/inf, retention, preemption, async save)
    Flag("--skip-nonfinite", "training", "skip_nonfinite", _bool,
         "skip (count and log) an update whose loss or grad norm is NaN/inf instead of "
         "stopping; bare flag = true"),
    Flag("--keep-last", "training", "keep_last", int,
         "keep the newest N checkpoints (0 = all); the one 'latest' names is never deleted"),
    Flag("--ckpt-step", "training", "ckpt_step", int,
         "with --load: load iter_<N> instead of the one 'latest' points at"),
    Flag("--exit-duration-in-mins", "training", "exit_duration_in_mins", float,
         "save and exit with status 3 (requeue) after this many minutes"),
    Flag("--exit-interval", "training", "exit_interval", int,
         "save and exit with status 3 after a step that is a multiple of N"),
    Flag("--async-save", "training", "async_save", _bool,
         "write checkpoints in the background (Megatron dist-checkpointing async); "
         "bare flag = true"),
    # --- logging
    Flag("--log-interval", "logging", "log_interval", int, "steps between progress lines"),
    Flag("--run-dir", "logging", "run_dir", str,
         "directory for config.yaml, metrics.jsonl and TensorBoard events"),
    Flag("--tensorboard", "logging", "tensorboard", _bool, "write TensorBoard events; true/false"),
    Flag("--routing-metrics", "logging", "routing_metrics", _bool,
         "per-layer expert load and aux loss in the logs; true/false"),
]


def build_parser(description: str = "megatron_mvmoe pretraining") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, epilog="Every flag overrides one field of the run config "
        "(shown as [section.field]); unset flags keep the YAML / preset value, an empty "
        "string clears an optional field.")
    parser.add_argument("--config", help="run config YAML (examples/*.yaml); flags override it")
    for flag in FLAGS:
        # Booleans also work as bare switches (`--bitnet` = `--bitnet true`).
        switch = dict(nargs="?", const=True) if flag.type is _bool else {}
        parser.add_argument(flag.name, type=flag.type, default=None, metavar=_metavar(flag),
                            help=f"{flag.help} [{flag.section}.{flag.field}]", **switch)
    return parser


def _metavar(flag: Flag) -> str:
    return {int: "N", float: "X", _bool: "BOOL"}.get(flag.type, "STR")


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
