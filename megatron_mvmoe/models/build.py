"""A run's model on this rank: run config -> MVMoETransformerConfig -> GPTModel
chunks on the device. Nothing else: no DDP, optimizer or scheduler (training/build.py wraps
these chunks for training; the analysis and checkpoint tools use them as they are).

Design choices:
- The one code path for making a run's chunks: the trainer (`training/build.build_trainer`),
  warm start, and the tools that open a checkpoint (`toolkit/checkpoint.py`) all call
  `build_model` / `model_config`, so a tool sees the very modules the trainer trains.
- Takes the run's `RunConfig` (config/run_config.py, imported for annotations only). What is
  read from it: `run.model` (the resolved model section), `run.parallel` (tp, pp, ep, etp, vpp),
  `run.training.precision` and `run.training.seed`.
- The RNG is seeded with the run's seed right before the chunks are built, as the trainer
  always did, so a fresh init is the trainer's step-0 model bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch
from megatron.core.models.gpt import GPTModel

from megatron_mvmoe import platform
from megatron_mvmoe.config.model_section import run_field_names
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.layers.dispatchers import install_dispatchers
from megatron_mvmoe.models.provider import build_model_chunks, transformer_config

if TYPE_CHECKING:
    from megatron_mvmoe.config.run_config import RunConfig


def use_bf16(run: "RunConfig") -> bool:
    """The run's precision on this machine: auto = bf16 on a GPU, fp32 on the CPU."""
    if run.training.precision == "auto":
        return platform.is_cuda()
    return run.training.precision == "bf16"


def model_config(run: "RunConfig") -> MVMoETransformerConfig:
    """The run's full Megatron config for its layout on this machine (provider's one
    translation of the resolved model section)."""
    p = run.parallel
    config = transformer_config(run.model, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                                cp=p.cp, pp_layout=p.pp_layout, use_bf16=use_bf16(run),
                                on_cpu=not platform.is_cuda(),
                                use_fp16=run.training.precision == "fp16",
                                optimizer=run.optimizer)
    # A training switch that Megatron reads from the model config: its schedule, DDP's
    # gradient scaling, finalize_model_grads and the aux-loss scale (training/step.py).
    config.calculate_per_token_loss = run.training.calculate_per_token_loss
    return config


def validate_run(run: "RunConfig", world_size: Optional[int] = None,
                 num_layers: Optional[int] = None,
                 num_experts: Optional[int] = None) -> MVMoETransformerConfig:
    """Every check of a run before any process group or weight exists: the run config's
    fields (`RunConfig.validate`, with world_size also the layout), then the variant's and
    Megatron's on the Megatron config built for the layout, errors naming the field as the
    YAML / flags write it. Returns that config."""
    run.validate(world_size, num_layers, num_experts)
    try:
        return model_config(run)
    except ValueError as err:
        raise ValueError(run_field_names(str(err))) from None


def build_model(run: "RunConfig", pg_collection,
                config: Optional[MVMoETransformerConfig] = None) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), seeded with the run's seed
    and placed on `platform.device()`. Every chunk holds the same config object
    (`chunks[0].config`), the one the trainer hangs its schedule hooks on."""
    config = model_config(run) if config is None else config  # validate_run's, once a launch
    platform.seed_all(run.training.seed)
    chunks = build_model_chunks(config, run.model, pg_collection)
    for chunk in chunks:  # model.moe_dispatcher (layers/dispatchers.py); alltoall: as built
        install_dispatchers(chunk, config)
    device = platform.device()
    for chunk in chunks:
        chunk.to(device)
        _params_to_model_dtype(chunk, config.params_dtype)
    return chunks


def _params_to_model_dtype(chunk: GPTModel, dtype: torch.dtype) -> None:
    """Every floating parameter in `dtype`, as Megatron-LM's Float16Module leaves a bf16
    model: torch norms (WrappedTorchNorm, ours) are built in fp32, and an fp32 parameter among
    bf16 ones breaks Megatron's non-distributed bf16 optimizer, whose checkpoint map counts
    only its float16 parameters ("Param id N does not match any model sharded param";
    tests/training/test_megatron_lm_defaults_parity.py). Buffers (the expert bias) keep
    their dtype."""
    for param in chunk.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
