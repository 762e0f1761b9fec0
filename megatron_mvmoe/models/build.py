"""A run's model on this rank: run config -> ModelShape -> MVMoETransformerConfig -> GPTModel
chunks on the device. Nothing else: no DDP, optimizer or scheduler (training/build.py wraps
these chunks for training; the analysis and checkpoint tools use them as they are).

Design choices:
- The one code path for making a run's chunks: the trainer (`training/build.build_trainer`),
  warm start, and the tools that open a checkpoint (`analysis/model_access.py`,
  `training/from_checkpoint.py`) all call `build_model` / `model_config`, so a tool sees
  the very modules the trainer trains.
- The run object is taken duck-typed (annotated 'RunConfig'): it is the training config's
  `RunConfig`, but models/ must not import training (tests/test_dependency_rules.py). What
  is read from it: `run.model` (the model section), `run.parallel` (tp, pp, ep, etp, vpp),
  `run.training.precision` and `run.training.seed`.
- The RNG is seeded with the run's seed right before the chunks are built, as the trainer
  always did, so a fresh init is the trainer's step-0 model bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron.core.models.gpt import GPTModel

from megatron_mvmoe import platform
from megatron_mvmoe.config import MVMoETransformerConfig
from megatron_mvmoe.models.presets import ModelShape, resolve_model
from megatron_mvmoe.models.provider import build_model_chunks, transformer_config


def use_bf16(run: "RunConfig") -> bool:
    if run.training.precision == "auto":
        return platform.is_cuda()
    return run.training.precision == "bf16"


def model_config(run: "RunConfig", shape: Optional[ModelShape] = None
                 ) -> MVMoETransformerConfig:
    """The run's full Megatron config for its layout on this machine."""
    shape = shape or resolve_model(run.model)
    p = run.parallel
    config = transformer_config(shape, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                                use_bf16=use_bf16(run), on_cpu=not platform.is_cuda(),
                                bitnet=bool(run.model.bitnet))
    return apply_model_switches(config, run.model)


def apply_model_switches(config: MVMoETransformerConfig, model) -> MVMoETransformerConfig:
    """The run's Multi-View / BitNet switches (ModelSection fields that are not part of the
    ModelShape) on the nested configs; None keeps the layer default. Revalidated after."""
    view_fields = {"stop_grad_mixing": model.stop_grad_mixing, "gate_scale": model.gate_scale,
                   "learned_gate_scale": model.learned_gate_scale,
                   "kernels": model.multi_view_kernels}
    chosen = {k: v for k, v in view_fields.items() if v is not None}
    if chosen:
        config.multi_view = dataclasses.replace(config.multi_view, **chosen)
    if model.bitnet is not None:
        config.bitnet = dataclasses.replace(config.bitnet, enabled=bool(model.bitnet))
    config.validate_mvmoe()
    return config


def build_model(run: "RunConfig", pg_collection) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), seeded with the run's seed
    and placed on `platform.device()`. Every chunk holds the same config object
    (`chunks[0].config`), the one the trainer hangs its schedule hooks on."""
    shape = resolve_model(run.model)
    config = model_config(run, shape)
    platform.seed_all(run.training.seed)
    chunks = build_model_chunks(config, shape, pg_collection)
    device = platform.device()
    for chunk in chunks:
        chunk.to(device)
    return chunks
