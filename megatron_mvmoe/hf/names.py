"""Weight names and layouts: a Megatron-Core GPTModel state dict <-> a transformers one.

Legend: G key/value groups, H attention heads, C head dim, D hidden size, F expert width,
E experts.

Design choices:
- Our own class (`MVMoEForCausalLM`, hf/remote/) keeps Megatron's names and layouts under
  `model.`, the LM head as `lm_head.weight`: `to_mvmoe` / `from_mvmoe` are renames, so export
  -> import is bit-identical for every variant.
- The stock classes (Llama, Mixtral, Glm4Moe) need three layout changes, each written once
  with its inverse: Megatron's fused QKV (per query group: H/G query heads, one key, one value)
  <-> q/k/v_proj; SwiGLU fc1 [gate; up] <-> gate_proj / up_proj (or the fused experts'
  gate_up_proj [E, 2F, D], same row order); SequentialMLP's per-expert weights <-> the
  stacked [E, ...] expert tensors.
- Megatron's `_extra_state` entries (TE's FP8 metadata; None without TE) carry no weights
  and are dropped; a non-None one is refused.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch

from megatron_mvmoe.errors import require

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
TOP_LEVEL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight",
             "output_layer.weight": "lm_head.weight"}


def weights_only(state: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The tensors of a Megatron state dict (None `_extra_state` entries dropped)."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state"):
            require(value is None or (isinstance(value, torch.Tensor) and value.numel() == 0),
                    name, "holds TransformerEngine extra state (FP8 metadata) the export "
                    "cannot carry", "export a checkpoint trained without FP8")
            continue
        out[name] = value
    return out


# ---- our own class: renames ------------------------------------------------------------
def to_mvmoe(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Megatron names -> MVMoEForCausalLM names (same tensors)."""
    return {("lm_head.weight" if name == "output_layer.weight" else "model." + name): t
            for name, t in state.items()}


def from_mvmoe(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """MVMoEForCausalLM names -> Megatron names (the inverse of `to_mvmoe`)."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            out["output_layer.weight"] = t
        else:
            require(name.startswith("model."), name, "is not a MVMoEForCausalLM weight",
                    "export the directory again with tools/export_hf.py")
            out[name[len("model."):]] = t
    return out


# ---- layouts shared by the stock classes -----------------------------------------------
def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron linear_qkv [G*(H/G+2)*C, D] -> (q [H*C, D], k [G*C, D], v [G*C, D])."""
    per_group = heads // groups
    grouped = qkv.view(groups, per_group + 2, head_dim, -1)
    q = grouped[:, :per_group].reshape(heads * head_dim, -1)
    k = grouped[:, per_group].reshape(groups * head_dim, -1)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int,
              head_dim: int) -> torch.Tensor:
    """The inverse of split_qkv."""
    per_group = heads // groups
    d = q.shape[-1]
    grouped = torch.cat([q.view(groups, per_group, head_dim, d),
                         k.view(groups, 1, head_dim, d), v.view(groups, 1, head_dim, d)], 1)
    return grouped.reshape(-1, d).contiguous()


def _swiglu_to(prefix: str, fc1: torch.Tensor, fc2: torch.Tensor) -> Dict[str, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return {f"{prefix}.gate_proj.weight": gate.contiguous(),
            f"{prefix}.up_proj.weight": up.contiguous(), f"{prefix}.down_proj.weight": fc2}


def _swiglu_from(prefix: str, hf: Dict[str, torch.Tensor], megatron_prefix: str):
    fc1 = torch.cat([hf[f"{prefix}.gate_proj.weight"], hf[f"{prefix}.up_proj.weight"]], 0)
    return {f"{megatron_prefix}.linear_fc1.weight": fc1,
            f"{megatron_prefix}.linear_fc2.weight": hf[f"{prefix}.down_proj.weight"]}


class StockNames:
    """Megatron <-> one stock class (Llama, Mixtral, Qwen3Moe or Glm4Moe) for a model's
    shape."""

    def __init__(self, hf_class: str, heads: int, groups: int, head_dim: int,
                 num_experts: Optional[int], mlp_layer_types: List[str]) -> None:
        self.hf_class, self.heads, self.groups, self.head_dim = hf_class, heads, groups, head_dim
        self.num_experts = num_experts
        self.mlp_layer_types = mlp_layer_types

    # Megatron -> HF
    def to_hf(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {TOP_LEVEL[name]: state[name] for name in TOP_LEVEL}
        for i, kind in enumerate(self.mlp_layer_types):
            mine = {m.group(2): t for name, t in state.items()
                    if (m := LAYER.match(name)) and int(m.group(1)) == i}
            out.update(self._layer_to_hf(f"model.layers.{i}", mine, kind))
        unused = set(state) - set(TOP_LEVEL) - {n for n in state if LAYER.match(n)}
        require(not unused, "checkpoint", f"weights {sorted(unused)} have no place in "
                f"{self.hf_class}", "export with --hf-class mvmoe")
        return out

    def _layer_to_hf(self, p: str, w: Dict[str, torch.Tensor], kind: str):
        q, k, v = split_qkv(w.pop("self_attention.linear_qkv.weight"), self.heads,
                            self.groups, self.head_dim)
        out = {f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
               f"{p}.self_attn.v_proj.weight": v,
               f"{p}.self_attn.o_proj.weight": w.pop("self_attention.linear_proj.weight"),
               f"{p}.input_layernorm.weight": w.pop("input_layernorm.weight"),
               f"{p}.post_attention_layernorm.weight": w.pop("pre_mlp_layernorm.weight")}
        if self.hf_class == "Qwen3MoeForCausalLM":  # Megatron's per-head QK RMSNorm
            out[f"{p}.self_attn.q_norm.weight"] = w.pop("self_attention.q_layernorm.weight")
            out[f"{p}.self_attn.k_norm.weight"] = w.pop("self_attention.k_layernorm.weight")
        if kind == "dense":
            out.update(_swiglu_to(f"{p}.mlp", w.pop("mlp.linear_fc1.weight"),
                                  w.pop("mlp.linear_fc2.weight")))
        else:
            out.update(self._moe_to_hf(f"{p}.mlp", w))
        require(not w, p, f"weights {sorted(w)} have no place in {self.hf_class}",
                "export with --hf-class mvmoe")
        return out

    def _moe_to_hf(self, p: str, w: Dict[str, torch.Tensor]):
        experts = range(self.num_experts)
        fc1 = [w.pop(f"mlp.experts.local_experts.{e}.linear_fc1.weight") for e in experts]
        fc2 = [w.pop(f"mlp.experts.local_experts.{e}.linear_fc2.weight") for e in experts]
        out = {f"{p}.gate.weight": w.pop("mlp.router.weight"),
               f"{p}.experts.gate_up_proj": torch.stack(fc1), f"{p}.experts.down_proj":
               torch.stack(fc2)}
        if self.hf_class == "Glm4MoeForCausalLM":
            bias = w.pop("mlp.router.expert_bias", None)
            out[f"{p}.gate.e_score_correction_bias"] = (
                bias if bias is not None else torch.zeros(self.num_experts))
            out.update(_swiglu_to(f"{p}.shared_experts", w.pop("mlp.shared_experts.linear_fc1"
                                                               ".weight"),
                                  w.pop("mlp.shared_experts.linear_fc2.weight")))
        return out

    # HF -> Megatron
    def from_hf(self, hf: Dict[str, torch.Tensor],
                with_expert_bias: bool = False) -> Dict[str, torch.Tensor]:
        out = {name: hf[hf_name] for name, hf_name in TOP_LEVEL.items()}
        for i, kind in enumerate(self.mlp_layer_types):
            out.update(self._layer_from_hf(f"model.layers.{i}", hf, f"decoder.layers.{i}",
                                           kind, with_expert_bias))
        return out

    def _layer_from_hf(self, p: str, hf, m: str, kind: str, with_expert_bias: bool):
        out = {f"{m}.self_attention.linear_qkv.weight": merge_qkv(
                   hf[f"{p}.self_attn.q_proj.weight"], hf[f"{p}.self_attn.k_proj.weight"],
                   hf[f"{p}.self_attn.v_proj.weight"], self.heads, self.groups, self.head_dim),
               f"{m}.self_attention.linear_proj.weight": hf[f"{p}.self_attn.o_proj.weight"],
               f"{m}.input_layernorm.weight": hf[f"{p}.input_layernorm.weight"],
               f"{m}.pre_mlp_layernorm.weight": hf[f"{p}.post_attention_layernorm.weight"]}
        if self.hf_class == "Qwen3MoeForCausalLM":
            out[f"{m}.self_attention.q_layernorm.weight"] = hf[f"{p}.self_attn.q_norm.weight"]
            out[f"{m}.self_attention.k_layernorm.weight"] = hf[f"{p}.self_attn.k_norm.weight"]
        if kind == "dense":
            out.update(_swiglu_from(f"{p}.mlp", hf, f"{m}.mlp"))
            return out
        out[f"{m}.mlp.router.weight"] = hf[f"{p}.mlp.gate.weight"]
        gate_up, down = hf[f"{p}.mlp.experts.gate_up_proj"], hf[f"{p}.mlp.experts.down_proj"]
        for e in range(self.num_experts):
            out[f"{m}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e].clone()
            out[f"{m}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e].clone()
        if self.hf_class == "Glm4MoeForCausalLM":
            if with_expert_bias:
                out[f"{m}.mlp.router.expert_bias"] = hf[f"{p}.mlp.gate.e_score_correction_bias"]
            out.update(_swiglu_from(f"{p}.mlp.shared_experts", hf, f"{m}.mlp.shared_experts"))
        return out

