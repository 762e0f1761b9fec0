"""Typed run configuration: model, layout, optimizer, data, training, logging.

Design choices:
- One dataclass per concern, every field documented; `RunConfig` nests them (the sections:
  config/run_sections.py), and the model section nests our model configs
  (config/model_section.py). A YAML file (examples/*.yaml) mirrors the nesting;
  Megatron-style command-line flags (config/flags.py) set single fields of the same nested
  mapping before it is loaded, so a recipe plus a few flags fully describes a run and
  `RunConfig.to_dict()` is what gets written into the run directory.
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
from typing import Any, Dict, Optional, Sequence

import yaml

from megatron_mvmoe.config.model_section import (LEGACY_FIELDS, ModelSection,
                                                 model_section_from_dict)
from megatron_mvmoe.config.run_sections import (  # noqa: F401 (importers' names)
    WARM_START_NEW_HEADS, DataSection, LoggingSection, LrDecayStyle, OptimizerSection,
    ParallelSection, TrainingSection, WarmStartNewHeads, _check_muon,
    check_megatron_fsdp)
from megatron_mvmoe.config.typed_config import check_literals, dataclass_from_dict
from megatron_mvmoe.errors import require as _require


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
        _check_muon(self.optimizer, self.training.precision)
        check_megatron_fsdp(self.optimizer, self.training, self.parallel.pp)
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
    parallel = sections["parallel"]
    if parallel.pp_layout is not None:  # Megatron-LM: the layout's stage count sets vpp
        parallel.vpp = parallel.layout_vpp()
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
