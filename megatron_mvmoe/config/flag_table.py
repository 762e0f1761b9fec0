"""The flag table: each Megatron-style flag of the trainer -> (section, field, type), with
only what the field's docstring cannot say (Megatron-LM's names, pass-through notes,
switches that set a value). config/flags.py builds the parser and applies the flags from
it; a new flag is one row here plus its field (with a docstring) in the run config."""

from __future__ import annotations

import argparse
from typing import Any, Callable, List, NamedTuple, Optional

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


def parse_moe_freq(text: str):
    """Megatron-LM's own `moe_freq_type` (an int N, or a Python list expression such as
    '[0]*1+[1]*3'), imported only when the flag is given."""
    from megatron.training.arguments import moe_freq_type
    try:
        return moe_freq_type(text)
    except Exception as err:  # eval of a malformed expression
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def parse_window(text: str) -> list:
    """Megatron-LM's --window-size ("127,0": tokens before, after), as its own `tuple_type`
    reads it; a list, so the run config's YAML and the checkpoint fingerprint hold it."""
    from megatron.training.arguments import tuple_type
    try:
        return list(tuple_type(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts", "gdn_norm_out")
"""Megatron-Core 0.19.2's selective-recompute modules (TransformerConfig.__post_init__
asserts on any other name; checked here so a typo is one line)."""


def parse_recompute_module(text: str) -> str:
    if text not in RECOMPUTE_MODULES:
        raise argparse.ArgumentTypeError(f"unknown module {text!r}; Megatron's are "
                                         f"{', '.join(RECOMPUTE_MODULES)}")
    return text


def parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_drop_policy(text: str) -> str:
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
    Flag("--num-distributed-optimizer-instances", "parallel", "distributed_optimizer_instances",
         int),
    Flag("--use-tp-pp-dp-mapping", "parallel", "rank_order", None,
         "Megatron-LM's switch for data-parallel replicas outermost", const="tp-cp-ep-pp-dp"),
    Flag("--virtual-pipeline-model-parallel-size", "parallel", "vpp", int),
    Flag("--pipeline-model-parallel-layout", "parallel", "pp_layout", str,
         "which stage holds E (embedding), t (layers), m (MTP), L (loss), e.g. 'Et|ttL'"),
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
    Flag("--max-position-embeddings", "model", "max_position_embeddings", int),
    Flag("--rotary-base", "model", "rotary_base", int),
    # --- architecture (Megatron-LM's meaning; a Megatron-LM style line without them gets
    # Megatron-LM's GPT-3 choices: megatron_lm_rules.apply_megatron_lm_defaults)
    Flag("--swiglu", "model", "swiglu", None, "Megatron-LM's switch for SwiGLU", const=True),
    Flag("--quick-geglu", "model", "quick_geglu", None,
         "Megatron-LM's switch for GPT-OSS's gated quick-GeLU", const=True),
    Flag("--glu-linear-offset", "model", "extra.glu_linear_offset", float,
         "added to the linear half of a gated unit: act(gate) * (linear + offset) (GPT-OSS 1.0)"),
    Flag("--activation-func-clamp-value", "model", "extra.activation_func_clamp_value", float,
         "a gated unit clamps its gate to <= v and its linear half to [-v, v] (GPT-OSS 7.0)"),
    Flag("--normalization", "model", "normalization", str),
    Flag("--position-embedding-type", "model", "position_embedding_type", str),
    # YaRN of standard attention (config/yarn.py; its scaling factor and mscales are MLA's
    # --rotary-scaling-factor / --mscale / --mscale-all-dim below, as in Megatron-LM)
    Flag("--yarn-original-max-position-embeddings", "model",
         "extra.yarn_original_max_position_embeddings", int,
         "YaRN: the context the frequencies are corrected for (default 4096)"),
    Flag("--yarn-beta-fast", "model", "extra.yarn_beta_fast", float,
         "YaRN: fast correction bound (default 32)"),
    Flag("--yarn-beta-slow", "model", "extra.yarn_beta_slow", float,
         "YaRN: slow correction bound (default 1)"),
    Flag("--yarn-correction-range-round-to-int", "model",
         "extra.yarn_correction_range_round_to_int", None,
         "YaRN: round the correction range to whole dimensions (the default)", const=True),
    Flag("--no-yarn-correction-range-round-to-int", "model",
         "extra.yarn_correction_range_round_to_int", None,
         "YaRN: keep the correction range fractional", const=False),
    Flag("--untie-embeddings-and-output-weights", "model",
         "untie_embeddings_and_output_weights", None, "Megatron-LM's switch for an LM head "
         "of its own", const=True),
    Flag("--disable-bias-linear", "model", "add_bias_linear", None,
         "Megatron-LM's switch for bias-free linear layers", const=False),
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
         "YaRN scaling factor of MLA, or of --position-embedding-type yarn (default 1.0)"),
    Flag("--mscale", "model", "extra.mscale", float,
         "YaRN mscale of MLA, or of --position-embedding-type yarn (default 1.0)"),
    Flag("--mscale-all-dim", "model", "extra.mscale_all_dim", float,
         "YaRN mscale_all_dim of MLA, or of --position-embedding-type yarn (default 0.0)"),
    Flag("--qk-layernorm", "model", "extra.qk_layernorm", None,
         "norm the queries and keys (MLA: its q/kv latents) in every layer", const=True),
    Flag("--window-size", "model", "extra.window_size", parse_window,
         "sliding-window attention: BEFORE,AFTER tokens seen (Megatron's DotProductAttention; "
         "SDPA falls back to it under --attention-backend auto)"),
    Flag("--window-attn-skip-freq", "model", "extra.window_attn_skip_freq", parse_moe_freq,
         "every N-th layer attends fully (or Megatron-LM's list form, 1 = full attention)"),
    Flag("--softmax-type", "model", "extra.softmax_type", str,
         "vanilla|off-by-one|learnable: attention sinks (Megatron's DotProductAttention)"),
    Flag("--no-bias-swiglu-fusion", "model", "bias_swiglu_fusion", None,
         "unfused SwiGLU (Megatron-LM's switch; the fusion runs on a GPU, and on CPU where "
         "inductor compiles and it pays: models/fast_paths.py)", const=False),
    Flag("--no-rope-fusion", "model", "apply_rope_fusion", None, "unfused RoPE", const=False),
    Flag("--no-masked-softmax-fusion", "model", "masked_softmax_fusion", None,
         "unfused scale-mask-softmax", const=False),
    Flag("--no-bias-dropout-fusion", "model", "bias_dropout_fusion", None,
         "unfused bias-dropout-add", const=False),
    Flag("--no-gradient-accumulation-fusion", "model", "gradient_accumulation_fusion", None,
         "weight gradients accumulate outside the GEMM", const=False),
    Flag("--moe-permute-fusion", "model", "moe_permute_fusion", None,
         "TE's fused permute where the platform has it (a Megatron-LM line without it: "
         "unfused)", const=True),
    Flag("--moe-router-fusion", "model", "moe_router_fusion", None,
         "TE's fused router where the platform has it (a Megatron-LM line without it: "
         "unfused)", const=True),
    Flag("--attention-backend", "model", "attention_backend", str,
         "Megatron-LM's choices (flash, fused, unfused, local, auto) plus sdpa"),
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
    Flag("--moe-token-drop-policy", "model", "extra.moe_token_drop_policy", parse_drop_policy,
         "probs|position: which C rows an expert keeps (probs: its largest gates)"),
    Flag("--moe-router-num-groups", "model", "extra.moe_router_num_groups", int,
         "expert groups of group-limited routing (DeepSeek: EP ranks or nodes)"),
    Flag("--moe-router-group-topk", "model", "extra.moe_router_group_topk", int,
         "groups a token may route to (with --moe-router-num-groups; Multi-Router: chosen "
         "on the summed sigmoid scores)"),
    Flag("--moe-layer-freq", "model", "extra.moe_layer_freq", parse_moe_freq,
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
    Flag("--recompute-modules", "model", "extra.recompute_modules", parse_recompute_module,
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
    Flag("--stop-grad-mixing", "model", "multi_view.stop_grad_mixing", parse_bool),
    Flag("--gate-scale", "model", "multi_view.gate_scale", float),
    Flag("--learned-gate-scale", "model", "multi_view.learned_gate_scale", parse_bool),
    Flag("--multi-view-kernels", "model", "multi_view.kernels", str),
    Flag("--bitnet", "model", "bitnet.enabled", parse_bool),
    # --- router trace (Megatron-LM's names)
    Flag("--moe-routing-trace-path", "logging", "moe_routing_trace_path", str),
    Flag("--moe-routing-trace-max-iters", "logging", "moe_routing_trace_max_iters", int),
    Flag("--moe-routing-trace-capture-logits", "logging", "moe_routing_trace_capture_logits",
         parse_bool),
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
    Flag("--torch-adam-impl", "optimizer", "torch_adam_impl", str),
    Flag("--use-distributed-optimizer", "optimizer", "use_distributed_optimizer", parse_bool),
    Flag("--use-megatron-fsdp", "optimizer", "megatron_fsdp", None,
         "Megatron-LM's switch for optimizer.megatron_fsdp true", const=True),
    Flag("--data-parallel-sharding-strategy", "optimizer", "data_parallel_sharding_strategy",
         str),
    Flag("--lr-decay-style", "optimizer", "lr_decay_style", str),
    Flag("--initial-loss-scale", "optimizer", "initial_loss_scale", float),
    Flag("--loss-scale", "optimizer", "loss_scale", float),
    Flag("--min-loss-scale", "optimizer", "min_loss_scale", float),
    Flag("--loss-scale-window", "optimizer", "loss_scale_window", float),
    Flag("--hysteresis", "optimizer", "hysteresis", int),
    Flag("--check-weight-hash-across-dp-replicas-interval", "training",
         "check_weight_hash_interval", int),
    Flag("--optimizer", "optimizer", "optimizer", str),
    Flag("--muon-momentum", "optimizer", "muon_momentum", float),
    Flag("--muon-scale-mode", "optimizer", "muon_scale_mode", str),
    Flag("--muon-extra-scale-factor", "optimizer", "muon_extra_scale_factor", float),
    Flag("--no-use-layer-wise-param-layout", "optimizer", "use_layer_wise_param_layout", None,
         "Megatron-LM's switch for optimizer.use_layer_wise_param_layout false", const=False),
    Flag("--accumulate-allreduce-grads-in-fp32", "optimizer", "grad_reduce_in_fp32", None,
         "Megatron-LM's switch for optimizer.grad_reduce_in_fp32 true", const=True),
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
    Flag("--padded-vocab-size", "data", "padded_vocab_size", int),
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
    Flag("--load-optimizer", "training", "load_optimizer", parse_bool),
    Flag("--override-opt-param-scheduler", "training", "override_opt_param_scheduler", parse_bool),
    Flag("--use-checkpoint-opt-param-scheduler", "training",
         "use_checkpoint_opt_param_scheduler", parse_bool),
    Flag("--no-load-optim", "training", "load_optimizer", None,
         "Megatron-LM's switch for --load-optimizer false: step and data position from "
         "the checkpoint, fresh optimizer, schedule from its step 0", const=False),
    Flag("--finetune", "training", "finetune", None,
         "with --load take only the weights; step, data position, optimizer, scheduler and "
         "RNG start fresh (Megatron-LM's --finetune)", const=True),
    Flag("--ckpt-allow-unverified", "training", "ckpt_allow_unverified", None,
         "load a checkpoint without manifest.json (its bytes cannot be verified)",
         const=True),
    Flag("--ckpt-format", "training", "ckpt_format", str),
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
    Flag("--fp16", "training", "precision", None, "Megatron-LM's switch for --precision fp16 "
         "(dynamic loss scaling from 2**32, Megatron-LM's defaults)", const="fp16"),
    Flag("--apply-query-key-layer-scaling", "model", "extra.apply_query_key_layer_scaling",
         None, "fp16's attention-score scaling by the layer number, undone in an fp32 "
         "softmax (Megatron's DotProductAttention; the same function)", const=True),
    Flag("--calculate-per-token-loss", "training", "calculate_per_token_loss", None,
         "Megatron-LM's switch for training.calculate_per_token_loss true", const=True),
    Flag("--exit-on-nonfinite", "training", "exit_on_nonfinite", parse_bool),
    # --- fault tolerance (NaN/inf, retention, preemption, async save)
    Flag("--no-check-for-nan-in-loss-and-grad", "training", "exit_on_nonfinite", None,
         "Megatron-LM's switch for --exit-on-nonfinite false", const=False),
    Flag("--skip-nonfinite", "training", "skip_nonfinite", parse_bool),
    Flag("--keep-last", "training", "keep_last", int),
    Flag("--ckpt-step", "training", "ckpt_step", int),
    Flag("--exit-duration-in-mins", "training", "exit_duration_in_mins", float),
    Flag("--exit-interval", "training", "exit_interval", int),
    Flag("--async-save", "training", "async_save", parse_bool),
    # --- logging
    Flag("--log-interval", "logging", "log_interval", int),
    Flag("--logging-level", "logging", "logging_level", int),
    Flag("--run-dir", "logging", "run_dir", str),
    Flag("--tensorboard", "logging", "tensorboard", parse_bool),
    Flag("--routing-metrics", "logging", "routing_metrics", parse_bool),
    Flag("--a2a-metrics", "logging", "a2a_metrics", parse_bool),
    Flag("--a2a-ranks-per-node", "logging", "a2a_ranks_per_node", int),
    Flag("--tensorboard-dir", "logging", "tensorboard_dir", str, "turns TensorBoard on"),
    Flag("--wandb-project", "logging", "wandb_project", str),
    Flag("--wandb-exp-name", "logging", "wandb_exp_name", str),
    Flag("--wandb-save-dir", "logging", "wandb_save_dir", str),
]
