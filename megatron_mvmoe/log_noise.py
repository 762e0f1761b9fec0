"""Every log message this package hides, in one place: each one named, with the reason it
says nothing to a user of this trainer, and matched at its source (the logger or the
warning's module and category that emits it), never by silencing a category, a library or
all warnings.

Design choices:
- A `Noise` is one message: the logger that emits it (a logging record) or the warning
  category and module (a `warnings.warn`), and a regular expression its text starts with.
  Anything else from the same logger or module still prints.
- `install()` runs when `megatron_mvmoe` is imported (its __init__), before Megatron-Core
  and torch modules emit their import-time messages. It is idempotent: a filter already
  installed is not added twice.
- Only what a clean normal run prints and that does not concern the run is here. A
  message that points at something this package does wrong is fixed where it comes from
  instead (e.g. Megatron's "Overwriting old incomplete / corrupted checkpoint...", which the
  trainer used to trigger on every save by creating files in the checkpoint directory
  before Megatron's save: training/checkpoint.py).
- tests/training/test_log_noise.py checks that a short real training run (a save included) prints
  none of these and that each filter matches only its own message.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Type


@dataclass(frozen=True)
class Noise:
    name: str
    why: str
    message: str
    """Regular expression the message starts with (re.match)."""
    logger: Optional[str] = None
    """Logging record: the emitting logger's name."""
    category: Optional[Type[Warning]] = None
    """warnings.warn: the category."""
    module: str = ""
    """warnings.warn: the module (or package) the warning is attributed to."""
    example: str = ""
    """The message as it was printed (tests/training/test_log_noise.py emits it)."""


LOG_RECORDS: Tuple[Noise, ...] = (
    Noise("gpt_model_deprecated",
          "printed on every GPTModel build; this fork builds Megatron-Core's GPTModel on "
          "purpose (its MoE layers, specs and checkpoints), HybridModel is not its target",
          r"GPTModel IS DEPRECATED", logger="megatron.core.models.gpt.gpt_model",
          example="GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, "
                  "no new features."),
    Noise("mcore_async_save_deprecated",
          "Megatron's synchronous save goes through async_save(async_strategy='mcore') "
          "itself, so it prints on every save even with async saving off; the async path "
          "uses 'mcore' on purpose (NVRx is not installed; training/checkpoint.py)",
          r"MCore's async save is deprecated",
          logger="megatron.core.dist_checkpointing.strategies.torch",
          example="MCore's async save is deprecated and will be removed in the future "
                  "releases."),
    Noise("ddp_auto_param_layout",
          "Megatron's DDP computes the distributed optimizer's parameter layout itself when "
          "none is passed, with the same function a caller would call; nothing differs",
          r"DistributedDataParallel: full_param_layout not provided",
          logger="megatron.core.distributed.distributed_data_parallel",
          example="DistributedDataParallel: full_param_layout not provided with "
                  "use_distributed_optimizer=True."),
    Noise("torch_no_cuda_runtime",
          "torch's C++-extension helper notes at import that a CPU machine has no CUDA "
          "runtime; nothing here builds C++ extensions",
          r"No CUDA runtime is found, using CUDA_HOME", logger="torch.utils.cpp_extension",
          example="No CUDA runtime is found, using CUDA_HOME='/usr/local'"),
)

WARNINGS: Tuple[Noise, ...] = (
    Noise("te_apex_fallback",
          "Megatron-Core says at import, once per module, that TransformerEngine/Apex are "
          "absent and it uses torch implementations: expected on CPU machines",
          r".*(Transformer Engine|Apex) (and Apex )?(are|is) not installed",
          category=UserWarning,
          example="Transformer Engine and Apex are not installed. Falling back to local "
                  "implementations."),
    Noise("mimo_config_experimental",
          "megatron.core imports its multimodal (MIMO) config, which warns that it is "
          "experimental; this trainer does not use MIMO models",
          r"MimoModelConfig is experimental", category=UserWarning,
          module="megatron.core.models.mimo",
          example='MimoModelConfig is experimental and still under active development.'),
    Noise("cuda_graph_full_scope_deprecated",
          "Megatron's own default TransformerConfig.cuda_graph_modules='full' triggers its "
          "deprecation warning in __post_init__; no CUDA graphs are configured here",
          r"full scope is deprecated", category=UserWarning,
          module="megatron.core.transformer.transformer_config",
          example="full scope is deprecated. Use empty cuda_graph_modules to capture the "
                  "whole layer."),
    Noise("fp32_shard_grad_probe",
          "Megatron's distributed optimizer keeps fp32 shards as views of the parameters "
          "(non-leaf tensors) and its zero_grad probes their .grad, which torch warns about",
          r"The \.grad attribute of a Tensor that is not a leaf Tensor", category=UserWarning,
          module="megatron.core.optimizer.optimizer",
          example="The .grad attribute of a Tensor that is not a leaf Tensor is being "
                  "accessed."),
    Noise("c10d_tensor_collective_names",
          "Megatron's DDP and distributed optimizer call reduce_scatter_tensor / "
          "all_gather_into_tensor, which torch 2.13 renames; they work as before",
          r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
          r"deprecated", category=FutureWarning, module="torch.distributed.c10d_logger",
          example="`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                  "`torch.distributed.reduce_scatter_single` instead."),
    Noise("dcp_sharded_tensor_deprecated",
          "torch's checkpoint planner warns about ShardedTensor when Megatron's "
          "dist-checkpointing loads or saves (Megatron's format, not a choice made here)",
          r"Please use DTensor instead and we are deprecating ShardedTensor",
          category=FutureWarning, module="torch.distributed.checkpoint",
          example='Please use DTensor instead and we are deprecating ShardedTensor.'),
    Noise("dcp_no_dist_load",
          "Megatron's dist-checkpointing loads each rank's shards with no_dist=True on "
          "purpose (every rank reads what it needs), and torch says so on every load",
          r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
          r"intent is to load in a single process", category=UserWarning,
          module="torch.distributed.checkpoint",
          example="torch.distributed is disabled, unavailable or uninitialized, assuming "
                  "the intent is to load in a single process."),
    Noise("dcp_load_argument_order",
          "Megatron's dist-checkpointing passes the storage reader positionally, which torch "
          "accepts with this note",
          r"The argument order of load has been changed", category=UserWarning,
          module="torch.distributed.checkpoint",
          example="The argument order of load has been changed. Please check the document "
                  "to avoid future breakages."),
)


class _RecordFilter(logging.Filter):
    """Drops one message of one logger."""

    def __init__(self, noise: Noise):
        super().__init__()
        self.noise = noise
        self._pattern = re.compile(noise.message)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._pattern.match(record.getMessage())


def install() -> None:
    """Install every filter (idempotent)."""
    for noise in WARNINGS:
        module = re.escape(noise.module) + r"(\.|$)" if noise.module else ""
        warnings.filterwarnings("ignore", message=noise.message, category=noise.category,
                                module=module)
    for noise in LOG_RECORDS:
        logger = logging.getLogger(noise.logger)
        if not any(isinstance(f, _RecordFilter) and f.noise == noise for f in logger.filters):
            logger.addFilter(_RecordFilter(noise))


def hidden(text: str) -> Optional[str]:
    """The name of the filter that hides a line of console output, if any (for tests and
    for checking a saved log)."""
    for noise in LOG_RECORDS + WARNINGS:
        if re.search(noise.message, text):
            return noise.name
    return None


def apply_logging_level(level: Optional[int]) -> Optional[int]:
    """Megatron-LM's --logging-level: the root logger's level, from `level`, else the
    MEGATRON_LOGGING_LEVEL environment variable (Megatron-LM's precedence); returns the level
    set, None when neither is given (the level stays)."""
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)
    return level
