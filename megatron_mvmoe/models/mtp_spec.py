"""Multi-token prediction (MTP) block spec for every variant: `build_mtp_block_spec`.

Design choices:
- Megatron-Core's own MTP block (`transformer/multi_token_prediction.py`) through its own
  spec helper `get_gpt_mtp_block_spec_for_backend`: handed our finished decoder-block spec,
  it takes the block's LAST layer spec as the MTP layer's transformer layer. On the last
  pipeline stage (where Megatron puts every MTP layer) that is a layer whose MoE slot we
  already swapped (models/specs.py), so each MTP layer is built with the variant's MoE layer
  (LatentMoELayer, MultiViewMoELayer + MultiRouter, MH-MoE, or the stock MoELayer), and
  TransformerLayer hands it `is_mtp_layer=True`: the routers then record their aux losses
  under the MTP layer numbers and scale repeated layers once (Megatron's rule, mirrored by
  routing/router.py), so aux losses are counted once per MTP layer.
- The backend follows the block's: TransformerEngine only when the block uses it (never
  under BitNet). Without TE, Megatron's torch norm refuses sequence parallelism, so the
  MTP layer's three norms (enorm, hnorm, final layer norm) become
  `SequenceParallelTorchNorm` exactly like the decoder block's.
- Pipeline parallelism on CPU is refused: the MTP stage's embedding copy is synced by
  Megatron with a `.cuda()` call (one line naming it; TP and EP run).
- BitNet: the MTP layer's eh_proj is a Column-parallel linear and is quantized like every
  other linear of the block (`maybe_bitnet_spec`); the shared embedding and LM head stay
  full precision.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules)
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_mvmoe.layers.bitnet import maybe_bitnet_spec
from megatron_mvmoe.layers.norm import SequenceParallelTorchNorm

_MTP_NORM_SLOTS = ("enorm", "hnorm", "layer_norm")


def _block_uses_te(block: TransformerBlockSubmodules) -> bool:
    """Whether the finished decoder block was built from TransformerEngine modules."""
    return "transformer_engine" in getattr(block.layer_norm, "__module__", "")


def _backend(block: TransformerBlockSubmodules):
    if _block_uses_te(block):
        from megatron.core.models.backends import TESpecProvider  # needs TE installed

        return TESpecProvider()
    return LocalSpecProvider()


def _sequence_parallel_norms(spec: MultiTokenPredictionBlockSubmodules
                             ) -> MultiTokenPredictionBlockSubmodules:
    """Every WrappedTorchNorm slot of every MTP layer -> SequenceParallelTorchNorm."""
    def swap_layer(layer_spec):
        sub = layer_spec.submodules
        changes = {slot: SequenceParallelTorchNorm for slot in _MTP_NORM_SLOTS
                   if getattr(sub, slot) is WrappedTorchNorm}
        return replace(layer_spec, submodules=replace(sub, **changes))

    return replace(spec, layer_specs=[swap_layer(s) for s in spec.layer_specs])


def build_mtp_block_spec(config, block: TransformerBlockSubmodules,
                         vp_stage: Optional[int] = None
                         ) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """This stage's MTP block spec (None without `config.mtp_num_layers` or off the last
    stage), from the stage's finished decoder-block spec `block`."""
    if not config.mtp_num_layers:
        return None
    if not block.layer_specs:
        raise ValueError(
            "mtp_num_layers: the last pipeline stage holds no decoder layer to copy into the "
            "MTP layers. Fix: give the last stage at least one layer (num_layers >= pp*vpp)")
    spec = get_gpt_mtp_block_spec_for_backend(config=config, spec=block,
                                              backend=_backend(block), vp_stage=vp_stage)
    if spec is None:
        return None
    if config.sequence_parallel and not _block_uses_te(block):
        spec = _sequence_parallel_norms(spec)
    return maybe_bitnet_spec(spec, config)
