"""Megatron-style command-line flags that override single RunConfig fields.

Design choices:
- One table maps each flag to (section, field, type); the argparse parser and the
  override step are both generated from it, so a flag cannot exist without a field.
- A flag's help IS its field's docstring (config/field_docs.py), so the table keeps only
  what the docstrings cannot say: Megatron-LM's names, the notes of flags that set
  Megatron TransformerConfig fields we pass through (`extra.<name>`) or of switches that
  set a value (`--bf16`), and flag-only rules. Accepted and refused Megatron-LM flags are
  megatron_flags.py's and megatron_lm_table.py's.
- Flag names follow Megatron-LM's (`--tensor-model-parallel-size`, `--train-iters`, ...)
  with Megatron-LM's meaning, so launch scripts port over; an unset flag (None) leaves the
  YAML/preset value alone. Megatron-LM switches that describe what we always do, and flags
  we refuse with a reason, live in megatron_flags.py.
- Megatron-LM rules kept: `--ffn-hidden-size` also sets the expert width when
  `--moe-ffn-hidden-size` is not given; `--num-experts` without a preset or variant means
  a routed-expert MoE (smoe); the vocabulary is the tokenizer's, padded
  (`--make-vocab-size-divisible-by`); `--vocab-size` with NullTokenizer is its id count.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from megatron_mvmoe.config import megatron_flags, megatron_lm_rules, megatron_lm_table
from megatron_mvmoe.config.field_docs import doc_of
from megatron_mvmoe.config.presets import PRESETS
from megatron_mvmoe.config.run_config import (RunConfig, config_from_dict, read_yaml, set_field,
                                              unset_field)


class Flag(NamedTuple):
    name: str
    section: str
    field: str
    """Field of the section; dotted for a nested config ("multi_view.num_routers"), and
    "extra.<name>" sets a Megatron TransformerConfig field we do not model."""
    type: Callable
    note: str = ""
    """What the field's docstring (the help's first part) does not say: Megatron-LM's
    meaning of a passed-through `extra.<name>` field or of a switch, or a flag-only rule."""
    const: Any = None
    """A bare switch that sets this value (e.g. --bf16 -> precision bf16)."""
    nargs: Optional[str] = None


def _moe_freq(text: str):
    """Megatron-LM's own `moe_freq_type` (an int N, or a Python list expression such as
    '[0]*1+[1]*3'), imported only when the flag is given."""
    from megatron.training.arguments import moe_freq_type
    try:
        return moe_freq_type(text)
    except Exception as err:  # eval of a malformed expression
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts", "gdn_norm_out")
"""Megatron-Core 0.19.2's selective-recompute modules (TransformerConfig.__post_init__
asserts on any other name; checked here so a typo is one line)."""


def _recompute_module(text: str) -> str:
    if text not in RECOMPUTE_MODULES:
        raise argparse.ArgumentTypeError(f"unknown module {text!r}; Megatron's are "
                                         f"{', '.join(RECOMPUTE_MODULES)}")
    return text


def _bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _drop_policy(text: str) -> str:
    """Megatron-LM's --moe-token-drop-policy choices."""
    if text not in ("probs", "position"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of probs, position")
    return text


FLAGS: List[Flag] = [
    # --- parallel layout
    Flag("--tensor-model-parallel-size", "parallel", "tp", int,
         "with MoE needs EP > 1 or ETP = TP"),
    Flag("--pipeline-model-parallel-size", "parallel", "pp", int),
    Flag("--expert-model-parallel-size", "parallel", "ep", int),
    Flag("--expert-tensor-parallel-size", "parallel", "etp", int),
    Flag("--virtual-pipeline-model-parallel-size", "parallel", "vpp", int),
    Flag("--context-parallel-size", "parallel", "cp", int),
    Flag("--distributed-timeout-seconds", "parallel", "distributed_timeout_seconds", float),
    # --- model shape (None keeps the preset's value)
    Flag("--model-preset", "model", "preset", str,
         "e.g. tiny_multi_view, mvmoe_10b_a1b, seed2_mh_moe_h3, seed2_tiny_fine_grained"),
    Flag("--moe-variant", "model", "moe_variant", str),
    Flag("--moe-dispatcher", "model", "moe_dispatcher", str),
    Flag("--moe-dispatch-ranks-per-node", "model", "moe_dispatch_ranks_per_node", int),
    Flag("--num-layers", "model", "num_layers", int),
    Flag("--hidden-size", "model", "hidden_size", int),
    Flag("--num-attention-heads", "model", "num_attention_heads", int),
    Flag("--num-query-groups", "model", "num_query_groups", int),
    Flag("--ffn-hidden-size", "model", "ffn_hidden_size", int),
    Flag("--num-experts", "model", "num_experts", int),
    Flag("--moe-ffn-hidden-size", "model", "moe_ffn_hidden_size", int),
    Flag("--moe-router-topk", "model", "moe_router_topk", int),
    Flag("--moe-shared-expert-intermediate-size", "model",
         "moe_shared_expert_intermediate_size", int),
    Flag("--latent-size", "model", "latent_size", int),
    Flag("--num-routers", "model", "multi_view.num_routers", int),
    Flag("--num-views", "model", "multi_view.num_views", int),
    Flag("--gamma-ramp-steps", "model", "multi_view.gamma_ramp_steps", int),
    Flag("--num-heads-mh", "model", "multi_head.num_heads", int),
    Flag("--vocab-size", "model", "vocab_size", int),
    Flag("--seq-length", "model", "seq_length", int),
    Flag("--rotary-base", "model", "rotary_base", int),
    # --- attention: Megatron-Core's MLA and QK norm (config/mla_config.py; Megatron-LM's
    # defaults)
    Flag("--multi-latent-attention", "model", "extra.multi_latent_attention", None,
         "Megatron-Core's multi-latent attention (MLASelfAttention) in every layer, any "
         "variant", const=True),
    Flag("--q-lora-rank", "model", "extra.q_lora_rank", int,
         "MLA: rank of the query latent (default none: queries projected directly)"),
    Flag("--kv-lora-rank", "model", "extra.kv_lora_rank", int,
         "MLA: rank of the shared key/value latent (default 32)"),
    Flag("--qk-head-dim", "model", "extra.qk_head_dim", int,
         "MLA: query/key head width without the RoPE part (default 128)"),
    Flag("--qk-pos-emb-head-dim", "model", "extra.qk_pos_emb_head_dim", int,
         "MLA: RoPE part of the query/key head width (default 64)"),
    Flag("--v-head-dim", "model", "extra.v_head_dim", int, "MLA: value head width (default 128)"),
    Flag("--rope-type", "model", "extra.rope_type", str,
         "rope|yarn: MLA's rotary embedding (default yarn); standard attention is rope"),
    Flag("--rotary-scaling-factor", "model", "extra.rotary_scaling_factor", float,
         "MLA YaRN scaling factor (default 1.0)"),
    Flag("--mscale", "model", "extra.mscale", float, "MLA YaRN mscale (default 1.0)"),
    Flag("--mscale-all-dim", "model", "extra.mscale_all_dim", float,
         "MLA YaRN mscale_all_dim (default 0.0)"),
    Flag("--qk-layernorm", "model", "extra.qk_layernorm", None,
         "norm the queries and keys (MLA: its q/kv latents) in every layer", const=True),
    # --- Megatron TransformerConfig fields, passed through (Megatron's names and meaning)
    Flag("--moe-router-load-balancing-type", "model", "extra.moe_router_load_balancing_type",
         str, "aux_loss|seq_aux_loss|global_aux_loss|sinkhorn|none (default: aux_loss for "
         "smoe, none for the sigmoid latent variants)"),
    Flag("--moe-aux-loss-coeff", "model", "extra.moe_aux_loss_coeff", float,
         "load-balancing aux loss weight"),
    Flag("--moe-z-loss-coeff", "model", "extra.moe_z_loss_coeff", float, "router z-loss weight"),
    Flag("--moe-token-dispatcher-type", "model", "extra.moe_token_dispatcher_type", str,
         "alltoall|allgather (Multi-View needs alltoall: same bytes as the baseline)"),
    Flag("--moe-router-score-function", "model", "extra.moe_router_score_function", str,
         "softmax|sigmoid"),
    Flag("--moe-router-enable-expert-bias", "model", "extra.moe_router_enable_expert_bias",
         None, "aux-loss-free balancing bias (sigmoid routers)", const=True),
    Flag("--moe-router-bias-update-rate", "model", "extra.moe_router_bias_update_rate", float,
         "expert-bias update rate per global batch"),
    Flag("--moe-router-pre-softmax", "model", "extra.moe_router_pre_softmax", None,
         "softmax before top-k (Mixtral-style routers normalise after)", const=True),
    Flag("--moe-router-topk-scaling-factor", "model", "extra.moe_router_topk_scaling_factor",
         float, "scale on the routing probabilities"),
    Flag("--moe-router-dtype", "model", "extra.moe_router_dtype", str, "fp32|fp64 router math"),
    Flag("--moe-expert-capacity-factor", "model", "extra.moe_expert_capacity_factor", float,
         "expert capacity C = ceil(T*k/E * factor) rows per rank; rows beyond it drop "
         "(Megatron's rule, every variant; docs/features.md)"),
    Flag("--moe-pad-expert-input-to-capacity", "model",
         "extra.moe_pad_expert_input_to_capacity", None,
         "pad every expert to exactly C rows (needs --moe-expert-capacity-factor)", const=True),
    Flag("--moe-token-drop-policy", "model", "extra.moe_token_drop_policy", _drop_policy,
         "probs|position: which C rows an expert keeps (probs: its largest gates)"),
    Flag("--moe-router-num-groups", "model", "extra.moe_router_num_groups", int,
         "expert groups of group-limited routing (DeepSeek: EP ranks or nodes)"),
    Flag("--moe-router-group-topk", "model", "extra.moe_router_group_topk", int,
         "groups a token may route to (with --moe-router-num-groups; Multi-Router: chosen "
         "on the summed sigmoid scores)"),
    Flag("--moe-layer-freq", "model", "extra.moe_layer_freq", _moe_freq,
         "every N-th layer is MoE (1 = all), or Megatron-LM's list form, e.g. "
         "'[0]*1+[1]*3' (1 = MoE layer)"),
    Flag("--norm-epsilon", "model", "extra.layernorm_epsilon", float,
         "epsilon of the norms (Megatron-LM's name for TransformerConfig.layernorm_epsilon)"),
    Flag("--attention-softmax-in-fp32", "model", "extra.attention_softmax_in_fp32", None,
         "run the attention softmax in fp32", const=True),
    Flag("--init-method-std", "model", "extra.init_method_std", float, "weight init std"),
    Flag("--attention-dropout", "model", "extra.attention_dropout", float, "attention dropout"),
    Flag("--hidden-dropout", "model", "extra.hidden_dropout", float, "hidden dropout"),
    Flag("--kv-channels", "model", "extra.kv_channels", int, "attention head width"),
    Flag("--recompute-granularity", "model", "extra.recompute_granularity", str,
         "full|selective activation recomputation"),
    Flag("--recompute-method", "model", "extra.recompute_method", str, "uniform|block"),
    Flag("--recompute-num-layers", "model", "extra.recompute_num_layers", int,
         "layers per recompute unit"),
    Flag("--recompute-modules", "model", "extra.recompute_modules", _recompute_module,
         "with --recompute-granularity selective: Megatron's modules to recompute, e.g. moe "
         "(the whole MoE layer of every variant), core_attn, shared_experts (default core_attn)",
         nargs="+"),
    Flag("--moe-layer-recompute", "model", "extra.moe_layer_recompute", None,
         "recompute every MoE layer in the backward (Megatron's: selective granularity, adds "
         "moe to --recompute-modules, whose default core_attn stays)", const=True),
    Flag("--mtp-num-layers", "model", "extra.mtp_num_layers", int,
         "multi-token prediction: Megatron-Core's MTP block of this many layers, each built "
         "with the variant's MoE layer"),
    Flag("--mtp-loss-scaling-factor", "model", "extra.mtp_loss_scaling_factor", float,
         "weight of the mean MTP loss (Megatron-LM's default 0.1)"),
    # --- Multi-View / BitNet switches
    Flag("--stop-grad-mixing", "model", "multi_view.stop_grad_mixing", _bool),
    Flag("--gate-scale", "model", "multi_view.gate_scale", float),
    Flag("--learned-gate-scale", "model", "multi_view.learned_gate_scale", _bool),
    Flag("--multi-view-kernels", "model", "multi_view.kernels", str),
    Flag("--bitnet", "model", "bitnet.enabled", _bool),
    # --- router trace (Megatron-LM's names)
    Flag("--moe-routing-trace-path", "logging", "moe_routing_trace_path", str),
    Flag("--moe-routing-trace-max-iters", "logging", "moe_routing_trace_max_iters", int),
    Flag("--moe-routing-trace-capture-logits", "logging", "moe_routing_trace_capture_logits",
         _bool),
    # --- optimizer
    Flag("--lr", "optimizer", "lr", float),
    Flag("--min-lr", "optimizer", "min_lr", float),
    Flag("--lr-warmup-iters", "optimizer", "warmup_iters", int),
    Flag("--lr-warmup-init", "optimizer", "init_lr", float),
    Flag("--lr-decay-iters", "optimizer", "decay_iters", int),
    Flag("--weight-decay", "optimizer", "weight_decay", float),
    Flag("--clip-grad", "optimizer", "clip_grad", float),
    Flag("--adam-beta1", "optimizer", "adam_beta1", float),
    Flag("--adam-beta2", "optimizer", "adam_beta2", float),
    Flag("--adam-eps", "optimizer", "adam_eps", float),
    Flag("--use-distributed-optimizer", "optimizer", "use_distributed_optimizer", _bool),
    Flag("--lr-decay-style", "optimizer", "lr_decay_style", str),
    # --- data
    Flag("--data-kind", "data", "kind", str),
    Flag("--data-path", "data", "path", str, nargs="+"),
    Flag("--split", "data", "split", str),
    Flag("--train-data-path", "data", "train_path", str, nargs="+"),
    Flag("--valid-data-path", "data", "valid_path", str, nargs="+"),
    Flag("--test-data-path", "data", "test_path", str, nargs="+"),
    Flag("--data-cache-path", "data", "cache_path", str),
    Flag("--mock-data", "data", "mock", None,
         "Megatron-Core's MockGPTDataset (no files; needs a tokenizer, e.g. NullTokenizer)",
         const=True),
    Flag("--tokenizer-type", "data", "tokenizer_type", str),
    Flag("--vocab-file", "data", "vocab_file", str),
    Flag("--merge-file", "data", "merge_file", str),
    Flag("--tokenizer-model", "data", "tokenizer_model", str),
    Flag("--make-vocab-size-divisible-by", "data", "make_vocab_size_divisible_by", int),
    Flag("--data-loader", "data", "loader", str),
    # --- training
    Flag("--train-iters", "training", "train_iters", int),
    Flag("--global-batch-size", "training", "global_batch_size", int),
    Flag("--micro-batch-size", "training", "micro_batch_size", int),
    Flag("--rampup-batch-size", "training", "rampup_batch_size", int,
         nargs=3),
    Flag("--eval-interval", "training", "eval_interval", int),
    Flag("--eval-iters", "training", "eval_iters", int),
    Flag("--save", "training", "save", str, "an empty string = no saving"),
    Flag("--load", "training", "load", str),
    Flag("--load-optimizer", "training", "load_optimizer", _bool),
    Flag("--override-opt-param-scheduler", "training", "override_opt_param_scheduler", _bool),
    Flag("--use-checkpoint-opt-param-scheduler", "training",
         "use_checkpoint_opt_param_scheduler", _bool),
    Flag("--no-load-optim", "training", "load_optimizer", None,
         "Megatron-LM's switch for --load-optimizer false: step and data position from "
         "the checkpoint, fresh optimizer, schedule from its step 0", const=False),
    Flag("--finetune", "training", "finetune", None,
         "with --load take only the weights; step, data position, optimizer, scheduler and "
         "RNG start fresh (Megatron-LM's --finetune)", const=True),
    Flag("--ckpt-allow-unverified", "training", "ckpt_allow_unverified", None,
         "load a checkpoint without manifest.json (its bytes cannot be verified)",
         const=True),
    Flag("--ckpt-optimizer-format", "training", "ckpt_optimizer_format", str),
    Flag("--dist-ckpt-optim-fully-reshardable", "training", "ckpt_optimizer_format", None,
         "Megatron-LM's switch for --ckpt-optimizer-format fully_reshardable",
         const="fully_reshardable"),
    Flag("--save-interval", "training", "save_interval", int),
    Flag("--warm-start-from", "training", "warm_start_from", str),
    Flag("--warm-start-new-heads", "training", "warm_start_new_heads", str),
    Flag("--moe-use-upcycling", "training", "moe_use_upcycling", None,
         "upcycle a DENSE checkpoint into this MoE model (Megatron-Core's mapping for smoe, "
         "the zero-padded identity for latent/multi_router/multi_view): from --warm-start-from, "
         "or, Megatron-LM's way, from --load (then --save is resumed once it holds a "
         "checkpoint)", const=True),
    Flag("--seed", "training", "seed", int),
    Flag("--precision", "training", "precision", str),
    Flag("--bf16", "training", "precision", None, "Megatron-LM's switch for --precision bf16",
         const="bf16"),
    Flag("--exit-on-nonfinite", "training", "exit_on_nonfinite", _bool),
    # --- fault tolerance (NaN/inf, retention, preemption, async save)
    Flag("--no-check-for-nan-in-loss-and-grad", "training", "exit_on_nonfinite", None,
         "Megatron-LM's switch for --exit-on-nonfinite false", const=False),
    Flag("--skip-nonfinite", "training", "skip_nonfinite", _bool),
    Flag("--keep-last", "training", "keep_last", int),
    Flag("--ckpt-step", "training", "ckpt_step", int),
    Flag("--exit-duration-in-mins", "training", "exit_duration_in_mins", float),
    Flag("--exit-interval", "training", "exit_interval", int),
    Flag("--async-save", "training", "async_save", _bool),
    # --- logging
    Flag("--log-interval", "logging", "log_interval", int),
    Flag("--run-dir", "logging", "run_dir", str),
    Flag("--tensorboard", "logging", "tensorboard", _bool),
    Flag("--routing-metrics", "logging", "routing_metrics", _bool),
    Flag("--tensorboard-dir", "logging", "tensorboard_dir", str, "turns TensorBoard on"),
    Flag("--wandb-project", "logging", "wandb_project", str),
    Flag("--wandb-exp-name", "logging", "wandb_exp_name", str),
    Flag("--wandb-save-dir", "logging", "wandb_save_dir", str),
]


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one-line ValueErrors (exit 2 with one line in pretrain's
    main), never a usage dump."""

    def error(self, message: str):
        raise ValueError(f"{message}. Fix: see --help")


def build_parser(description: str = "megatron_mvmoe pretraining") -> argparse.ArgumentParser:
    parser = _Parser(
        description=description, allow_abbrev=False,  # a Megatron flag must not prefix-match ours
        epilog="Every flag overrides one field of the run config (shown as [section.field]); "
        "unset flags keep the YAML / preset value, an empty string clears an optional field. "
        "Megatron-LM switches that describe what this trainer always does are accepted and "
        f"noted at start-up: {' '.join(sorted(megatron_flags.ACCEPTED))}. Every other flag "
        "of Megatron-LM's arguments.py is known too (megatron_mvmoe/training/"
        "megatron_lm_flags.json): accepted with a note, or refused with the reason and what "
        "to use instead (megatron_lm_table.py); all refusals of a line are reported at once.")
    parser.add_argument("--config", help="run config YAML (examples/*.yaml); flags override it")
    parser.add_argument("--unset", action="append", default=[], metavar="SECTION.FIELD",
                        help="drop a field the YAML or the preset sets, as if never given "
                        "(its default; None = derived, e.g. --unset model.vocab_size takes "
                        "the tokenizer's vocabulary); repeatable")
    for flag in FLAGS:
        parser.add_argument(flag.name, default=None, help=flag_help(flag),
                            **_argument_kind(flag))
    group = parser.add_argument_group("Megatron-LM flags accepted as already true here")
    for name, rule in megatron_flags.ACCEPTED.items():
        takes_value = rule.values is not None or rule.any_value
        group.add_argument(name, dest=_compat_dest(name), default=None,
                           help=rule.note or "accepted",
                           **({"metavar": "VALUE"} if takes_value else
                              {"action": "store_const", "const": True}))
    megatron_lm_rules.add_converted_flags(parser)
    taken = {a for action in parser._actions for a in action.option_strings}
    megatron_lm_table.add_table_flags(parser, taken)
    return parser


def flag_help(flag: Flag) -> str:
    """The field's docstring, then the flag's note, then where it lands ([section.field])."""
    doc = doc_of(RunConfig, f"{flag.section}.{flag.field}") if flag.const is None else None
    parts = [part for part in (doc, flag.note) if part]
    if flag.type is _bool:
        parts.append("true/false; a bare flag = true")
    text = "; ".join(part.rstrip(".") for part in parts[:-1]) + ("; " if parts[1:] else "")
    return (text + (parts[-1] if parts else "")).replace("%", "%%") + \
        f" [{flag.section}.{flag.field}]"


def _compat_dest(name: str) -> str:
    return "compat_" + name.lstrip("-").replace("-", "_")


def _argument_kind(flag: Flag) -> dict:
    if flag.const is not None:
        return {"action": "store_const", "const": flag.const,
                "dest": _dest(flag)}
    # Booleans also work as bare switches (`--bitnet` = `--bitnet true`).
    switch = dict(nargs="?", const=True) if flag.type is _bool else {}
    if flag.nargs:
        switch["nargs"] = flag.nargs
    return dict(type=flag.type, metavar=_metavar(flag), dest=_dest(flag), **switch)


def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _metavar(flag: Flag) -> str:
    return {int: "N", float: "X", _bool: "BOOL", _moe_freq: "N|LIST"}.get(flag.type, "STR")


def apply_flags(raw: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Set every flag given on the command line on its field of the run config mapping
    `raw` (YAML's nesting; in place). An empty string clears an optional field (e.g.
    --save "" turns saving off)."""
    problems = _apply(raw, args)
    if problems:
        raise refusal_error(problems)
    return raw


def _apply(raw: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    for flag in FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            set_field(raw, f"{flag.section}.{flag.field}", None if value == "" else value)
    _megatron_rules(raw, args)
    return megatron_lm_rules.apply_conversions(raw, args) + \
        megatron_lm_rules.apply_megatron_lm_defaults(raw, args) + megatron_lm_rules.backend_problems(raw)


def _megatron_rules(raw: Dict[str, Any], args: argparse.Namespace) -> None:
    """Megatron-LM semantics that span fields (see the module docstring)."""
    model, data = raw.get("model") or {}, raw.get("data") or {}
    preset = PRESETS.get(model.get("preset"), {})
    if args.ffn_hidden_size is not None and args.moe_ffn_hidden_size is None \
            and model.get("moe_ffn_hidden_size", preset.get("moe_ffn_hidden_size")) is None:
        model["moe_ffn_hidden_size"] = args.ffn_hidden_size
    path = data.get("path")
    if isinstance(path, list) and len(path) == 1 and os.path.isdir(path[0]):
        data["path"] = path[0]  # our preprocessed directory, not a Megatron prefix
    if args.tensorboard_dir:
        raw.setdefault("logging", {})["tensorboard"] = True
    max_positions = args.compat_max_position_embeddings
    seq_length = model.get("seq_length", preset.get("seq_length"))
    if max_positions is not None and seq_length is not None and int(max_positions) < \
            seq_length:
        raise ValueError(f"--max-position-embeddings {max_positions}: below --seq-length "
                         f"{seq_length}. Fix: raise it or lower --seq-length")


def _table_given(args: argparse.Namespace):
    """(name, value) of the other Megatron-LM flags on the command line."""
    for name in megatron_lm_table.table():
        value = getattr(args, megatron_lm_table.dest(name), None)
        if value is not None:
            yield name, value


def compat_notes(args: argparse.Namespace) -> List[str]:
    """Notes for the accepted-as-is Megatron-LM flags given on the command line."""
    given = megatron_flags.notes(name for name in megatron_flags.ACCEPTED
                                 if getattr(args, _compat_dest(name)) is not None)
    return given + [v.note for v in (megatron_lm_table.classify(n, x) for n, x in
                                     _table_given(args)) if v.note]


def refusal_error(problems: List[str]) -> ValueError:
    """One error for all of a launch line's refusals (one line each)."""
    if len(problems) == 1:
        return ValueError(problems[0])
    return ValueError(f"{len(problems)} flags refused:\n  " + "\n  ".join(problems))


def flag_problems(args: argparse.Namespace, unknown: List[str],
                  known: Sequence[str]) -> List[str]:
    """Every refusal of a parsed launch line (unknown, unsupported, unsupported values)."""
    problems = megatron_flags.unknown_flag_lines(unknown, known) if unknown else []
    for name in megatron_flags.ACCEPTED:
        value = getattr(args, _compat_dest(name))
        if value is not None:
            try:
                megatron_flags.check_accepted(name, value)
            except ValueError as err:
                problems.append(str(err))
    for name, value in _table_given(args):
        if name in megatron_flags.UNSUPPORTED:
            why, instead = megatron_flags.UNSUPPORTED[name]
            problems.append(f"{name}: not supported: {why}. Use instead: {instead}")
            continue
        verdict = megatron_lm_table.classify(name, value)
        if verdict.refusal:
            problems.append(verdict.refusal)
    return problems


def parse_args(argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """argparse, with every unknown or unsupported flag of the line in one ValueError."""
    args, problems = _parse(argv, parser)
    if problems:
        raise refusal_error(problems)
    return args


def _parse(argv, parser) -> tuple:
    parser = parser or build_parser()
    args, unknown = parser.parse_known_args(argv)
    known = [a for action in parser._actions for a in action.option_strings]
    return args, flag_problems(args, unknown, known)


def _unset_conflicts(args: argparse.Namespace) -> List[str]:
    """--unset of a field that a flag of the same line sets."""
    return [f"--unset {path}: {flag.name} sets it on the same line. Fix: keep one of them"
            for path in args.unset for flag in FLAGS
            if f"{flag.section}.{flag.field}" == path and getattr(args, _dest(flag)) is not None]


def config_from_args(argv: Optional[Sequence[str]] = None,
                     parser: Optional[argparse.ArgumentParser] = None) -> RunConfig:
    """YAML (if --config) then flag overrides, validated field by field."""
    args, problems = _parse(argv, parser)
    raw = read_yaml(args.config) if args.config else {}
    problems += _apply(raw, args) + _unset_conflicts(args)  # every refusal in one error
    if problems:
        raise refusal_error(problems)
    config = config_from_dict(raw)
    for path in args.unset:
        unset_field(config, path)
    config.validate()
    if os.environ.get("RANK", "0") == "0":
        for note in compat_notes(args):
            print(f"note: {note}", file=sys.stderr, flush=True)
    return config
