"""Core attention on PyTorch's `scaled_dot_product_attention`, for machines without
TransformerEngine (issue 42 item 1).

Megatron-Core 0.19.2 has two core attentions: TE's (flash / fused / unfused kernels, TE
only) and its local `DotProductAttention` (baddbmm, masked softmax, dropout, bmm, each
saved for backward). Without TE every run used the latter; PyTorch's SDPA is one fused
kernel (flash / memory-efficient on a GPU, a flash kernel on CPU) with the same maths.

Design choices:
- A subclass of Megatron's `DotProductAttention` that keeps its constructor (heads and
  query groups per TP rank, softmax scale, dropout probability, sharded state dict) and
  replaces only `forward`: same inputs `[s, b, np, hn]` (keys/values `[s, b, ng, hn]`) of
  this TP rank's heads, same output `[s, b, np * hv]`, no parameters of its own, so
  checkpoints are identical and a run may switch backends on resume.
- Masks as Megatron's torch softmax path reads them: a given boolean mask (True = masked)
  wins; else a causal mask type is SDPA's `is_causal` (sq > 1); else no mask.
- Softmax scale: Megatron divides `softmax_scale` by the layer number under
  `apply_query_key_layer_scaling` and multiplies the scores back inside its softmax, an
  identity in fp32; SDPA gets the product. SDPA's kernels accumulate the softmax in fp32
  whatever the input dtype, i.e. `attention_softmax_in_fp32=True` always (for bf16 that is
  at least as accurate as Megatron's bf16 softmax; for fp32 the two are the same maths).
- Attention dropout is SDPA's `dropout_p`, drawn inside Megatron's RNG-tracker fork exactly
  where Megatron forks (not under sequence parallelism: Megatron's choice), so TP ranks draw
  their model-parallel stream and a resume continues it (the masks differ from Megatron's
  own bmm path, the stream they come from does not).
- GQA: SDPA's `enable_gqa` (no repeated keys/values in memory); MLA: queries/keys of
  qk + rope dims and values of v dims, which SDPA takes as they are.
- What SDPA cannot serve (sliding windows, softmax offsets, packed sequences, attention
  bias) is decided before the build: models/fast_paths.py `sdpa_attention` keeps Megatron's
  module with one start-up line, or the config refuses an explicit `sdpa`
  (config/model_section.py `sdpa_blocker`).

Wired: models/specs.py swaps the local `core_attention` slots when the config's
`sdpa_attention` is on; at CP > 1 the all-gather CP attention (layers/cp_attention.py) runs
its gathered keys/values through this forward. tests/layers/test_sdpa_attention.py checks
forward and gradients against Megatron's module at TP 1 and 2, with GQA and MLA.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_mvmoe.layers.cp_attention import CPDotProductAttention
from megatron_mvmoe.layers.local_mla import MLADotProductAttention


def torch_version() -> str:
    return torch.__version__.split("+")[0]


class SDPADotProductAttention(DotProductAttention):
    """Megatron's DotProductAttention with its forward on torch SDPA (see module doc)."""

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn | hv] -> [sq, b, np * hv]."""
        assert packed_seq_params is None and attention_bias is None, \
            "the SDPA core attention takes neither packed sequences nor a bias (fast_paths)"
        seq_q, batch = query.size(0), query.size(1)
        q_bnsh, k_bgsh, v_bgsh = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask, causal = self._sdpa_mask(attention_mask, attn_mask_type or self.attn_mask_type,
                                       seq_q)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with self._dropout_stream(dropout_p):
            context_bnsh = F.scaled_dot_product_attention(
                q_bnsh, k_bgsh, v_bgsh, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                scale=self._effective_scale(),
                enable_gqa=q_bnsh.size(1) != k_bgsh.size(1))
        return context_bnsh.permute(2, 0, 1, 3).reshape(seq_q, batch, -1)

    @staticmethod
    def _sdpa_mask(attention_mask, mask_type, seq_q: int):
        """(SDPA's boolean attn_mask, True = attend; is_causal) of Megatron's inputs."""
        if attention_mask is not None:
            return ~attention_mask, False
        return None, mask_type == AttnMaskType.causal and seq_q > 1

    def _effective_scale(self) -> float:
        """Megatron's scale times the coefficient its softmax multiplies back in (the layer
        number under apply_query_key_layer_scaling, else none)."""
        return self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def _dropout_stream(self, dropout_p: float):
        """Megatron's RNG-tracker fork where its DotProductAttention forks for dropout."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()


class SDPAMLADotProductAttention(SDPADotProductAttention, MLADotProductAttention):
    """MLA's core attention (layers/local_mla.py: v_channels-wide output) on SDPA."""


class CPSDPADotProductAttention(CPDotProductAttention, SDPADotProductAttention):
    """The all-gather CP attention (layers/cp_attention.py) with SDPA's forward on the
    gathered keys/values and its causal mask at global positions."""


class CPSDPAMLADotProductAttention(CPDotProductAttention, SDPAMLADotProductAttention):
    """The CP attention for MLA with SDPA's forward."""


SDPA_OF = {DotProductAttention: SDPADotProductAttention,
           MLADotProductAttention: SDPAMLADotProductAttention}
"""Megatron's local core attention (or our MLA fix of it) -> its SDPA form."""

CP_SDPA_OF = {SDPADotProductAttention: CPSDPADotProductAttention,
              SDPAMLADotProductAttention: CPSDPAMLADotProductAttention}
"""The SDPA forms at CP > 1."""
