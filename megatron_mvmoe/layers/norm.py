"""A torch LayerNorm / RMSNorm usable with sequence parallelism: `SequenceParallelTorchNorm`.

Megatron's torch fallback `WrappedTorchNorm` asserts `not config.sequence_parallel`, but MoE
with TP > 1 needs sequence parallelism, and CPU has neither apex nor TransformerEngine.
Under SP each TP rank normalises its own slice of the sequence with the same (replicated)
weights, so the only extra duty is Megatron's `sequence_parallel` parameter attribute:
finalize_model_grads then all-reduces these grads over TP. Same constructor as
WrappedTorchNorm, so it drops into any spec slot that takes a norm.
"""

from __future__ import annotations

import torch

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Builds torch.nn.LayerNorm / RMSNorm and tags its parameters for SP grad sync."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization: str = "LayerNorm"):
        if config.normalization not in _NORMS:
            raise ValueError(f"normalization: {config.normalization!r} has no torch norm here. "
                             f"Fix: use one of {sorted(_NORMS)}")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma: not supported by torch norms. "
                             "Fix: set it False")
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
