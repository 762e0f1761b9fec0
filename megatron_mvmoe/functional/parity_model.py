"""Whole-model parameters and FLOPs per token for the seed-2 family, and parity report rows.

Pure python. Builds on `parity.py` (read its conventions first). Extra conventions here:
- Attention: Q, K, V and output projections, 4 D^2 parameters, no bias; attention scores
  (Q K^T and A V) cost 2 * 2 * seq_length * D per token per layer (no causal halving, as in
  Megatron's FLOPs formula). Two RMSNorms per layer and a final one (D each).
- Layer placement follows Megatron's integer `moe_layer_freq`: layer i (0-based) is MoE when
  i % freq == 0, so 12 layers with freq 2 have 6 MoE layers (1st, 3rd, ...) and 6 dense ones.
- Embeddings: V x D, plus a V x D output layer unless `tied_embeddings=True` (GPTModel's
  `share_embeddings_and_output_weights` defaults to False); the LM head
  costs 2 D V per token. No learned position embeddings (RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_mvmoe.functional.parity import (
    FLOPS_TOLERANCE,
    PARAMS_TOLERANCE,
    MoELayerShape,
    exact_flops_per_token,
    layer_params,
    leading_flops_per_token,
    relative_deviation,
)


@dataclass(frozen=True)
class ParityModelDims:
    """Dimensions of a decoder-only model whose every `moe_layer_freq`-th FFN is an MoE layer."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """D."""
    vocab_size: int
    """V: embedding rows (padded vocabulary)."""
    seq_length: int
    """Tokens per sequence (only the attention-score FLOPs depend on it)."""
    dense_ffn: int
    """Intermediate size of the dense (non-MoE) SwiGLU FFNs."""
    moe: Optional[MoELayerShape] = None
    """The MoE layer; None for a dense model."""
    moe_layer_freq: int = 2
    """Megatron's integer frequency: layer i is MoE when i % freq == 0."""
    tied_embeddings: bool = False
    """Output layer shares the embedding matrix (GPTModel's default is untied)."""
    ffn_matrices: int = 3
    """Matrices of a dense FFN: 3 for SwiGLU."""

    @property
    def num_moe_layers(self) -> int:
        if self.moe is None:
            return 0
        return sum(1 for i in range(self.num_layers) if i % self.moe_layer_freq == 0)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers


def _backbone_params(model: ParityModelDims) -> int:
    """Everything but the FFN/MoE blocks: embeddings, attention, norms."""
    d = model.hidden_size
    embeddings = model.vocab_size * d * (1 if model.tied_embeddings else 2)
    per_layer = 4 * d * d + 2 * d
    return embeddings + model.num_layers * per_layer + d


def model_params(model: ParityModelDims) -> dict:
    """Total and active (per token) parameters of the whole model."""
    dense = model.num_dense_layers * model.ffn_matrices * model.hidden_size * model.dense_ffn
    base = _backbone_params(model) + dense
    if model.moe is None:
        return {"total": base, "active": base}
    moe = layer_params(model.moe)
    return {"total": base + model.num_moe_layers * moe.total,
            "active": base + model.num_moe_layers * moe.active}


def model_flops_per_token(model: ParityModelDims) -> int:
    """Leading-term FLOPs per token of the whole model (forward only)."""
    d = model.hidden_size
    attention = model.num_layers * (2 * 4 * d * d + 2 * 2 * model.seq_length * d)
    dense = model.num_dense_layers * 2 * model.ffn_matrices * d * model.dense_ffn
    moe = model.num_moe_layers * leading_flops_per_token(model.moe) if model.moe else 0
    return attention + dense + moe + 2 * d * model.vocab_size


def parity_row(name: str, model: ParityModelDims, reference: Optional[ParityModelDims],
               matched: bool) -> dict:
    """One report row: per-MoE-layer and whole-model params and FLOPs, deviation from the
    reference (its SMoE baseline) in %, and whether a claimed parity holds."""
    row = {"name": name, "matched": matched}
    params = model_params(model)
    row["model_params_total"] = params["total"]
    row["model_params_active"] = params["active"]
    row["model_flops_per_token"] = model_flops_per_token(model)
    if model.moe is not None:
        layer = layer_params(model.moe)
        exact = exact_flops_per_token(model.moe)
        row.update({
            "heads": model.moe.routed_rows, "experts": model.moe.num_experts,
            "expert_ffn": model.moe.expert_ffn, "topk": model.moe.topk,
            "layer_params_total": layer.total, "layer_params_active": layer.active,
            "layer_params_paper": layer.paper_total,
            "layer_flops_leading": leading_flops_per_token(model.moe),
            "layer_flops_exact": exact.total, "layer_gating_share": exact.gating_share,
        })
    if reference is not None and reference.moe is not None and model.moe is not None:
        ref_layer = layer_params(reference.moe)
        row["dev_layer_flops_pct"] = 100 * relative_deviation(
            row["layer_flops_leading"], leading_flops_per_token(reference.moe))
        row["dev_layer_flops_exact_pct"] = 100 * relative_deviation(
            row["layer_flops_exact"], exact_flops_per_token(reference.moe).total)
        row["dev_layer_params_pct"] = 100 * relative_deviation(
            row["layer_params_total"], ref_layer.total)
        ref_params = model_params(reference)
        row["dev_model_params_pct"] = 100 * relative_deviation(
            params["total"], ref_params["total"])
        row["dev_model_flops_pct"] = 100 * relative_deviation(
            row["model_flops_per_token"], model_flops_per_token(reference))
        row["within_tolerance"] = (abs(row["dev_layer_flops_pct"]) <= 100 * FLOPS_TOLERANCE
                                   and abs(row["dev_layer_params_pct"]) <= 100 * PARAMS_TOLERANCE)
    return row
