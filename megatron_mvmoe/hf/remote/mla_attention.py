"""Megatron-Core's multi-latent attention (MLASelfAttention, local backend) and its RoPE /
YaRN embedding, for MVMoEForCausalLM (trust_remote_code; imports only torch and math).

Legend: B batch, S query positions, K key positions, D hidden size, H heads, Q = qk_head_dim,
P = qk_pos_emb_head_dim, V = v_head_dim, Rq = q_lora_rank, Rkv = kv_lora_rank.

Design choices (each as megatron/core/transformer/multi_latent_attention.py computes it):
- queries: linear_q_proj (Rq None) or linear_q_down_proj -> q_layernorm -> linear_q_up_proj;
  keys/values: linear_kv_down_proj -> [latent Rkv | shared RoPE key P] -> kv_layernorm ->
  linear_kv_up_proj -> per head [k Q | v V]. The norms exist only with qk_layernorm.
- RoPE on the P part only, MLA-interleaved (even then odd channels, then rotate-half), with
  the YaRN frequencies and concentration factor (rope_type 'yarn') or plain RoPE ('rope');
  softmax scale = yarn_mscale(factor, mscale_all_dim)^2 / sqrt(Q + P).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(config) -> torch.Tensor:
    """YarnRotaryEmbedding.get_emb's blend of extrapolated and interpolated frequencies."""
    dim, base, factor = config.qk_pos_emb_head_dim, config.rope_theta, config.rotary_scaling_factor
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low = max(math.floor(_correction_dim(config.beta_fast, dim, base,
                                         config.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(config.beta_slow, dim, base,
                                         config.original_max_position_embeddings)), dim - 1)
    if low == high:
        high += 0.001  # Megatron's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    return inter * (1 - mask) + extra * mask


def mla_rope_cos_sin(position_ids_BS: torch.Tensor, config):
    """cos, sin [B, 1, S, P] of MLA's RoPE part, the concentration factor applied."""
    if config.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config)
        factor = config.rotary_scaling_factor
        concentration = (_yarn_mscale(factor) if config.mscale is None
                         or config.mscale_all_dim is None else
                         _yarn_mscale(factor, config.mscale)
                         / _yarn_mscale(factor, config.mscale_all_dim))
    else:
        dim = config.qk_pos_emb_head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32)
                                                / dim))
        concentration = 1.0
    freqs_BSc = position_ids_BS.float().unsqueeze(-1) * inv_freq.to(position_ids_BS.device)
    emb_BSP = torch.cat((freqs_BSc, freqs_BSc), dim=-1)
    return ((emb_BSP.cos() * concentration).unsqueeze(1),
            (emb_BSP.sin() * concentration).unsqueeze(1))


def _rotate_interleaved(x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Megatron's apply_rotary_pos_emb(mla_rotary_interleaved=True)."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class MLASelfAttention(nn.Module):
    """Megatron-Core's MLASelfAttention (unfused down projections, local backend)."""

    def __init__(self, config, layer_idx: int, linear, norm) -> None:
        super().__init__()
        self.layer_idx, self.heads = layer_idx, config.num_attention_heads
        self.q_dim, self.pos_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        d, q_rows = config.hidden_size, self.heads * (self.q_dim + self.pos_dim)
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.linear_q_down_proj = linear(d, config.q_lora_rank)
            self.linear_q_up_proj = linear(config.q_lora_rank, q_rows)
        else:
            self.linear_q_proj = linear(d, q_rows)
        self.linear_kv_down_proj = linear(d, self.kv_rank + self.pos_dim)
        self.linear_kv_up_proj = linear(self.kv_rank, self.heads * (self.q_dim + self.v_dim))
        self.q_layernorm = self.kv_layernorm = None
        if config.qk_layernorm:
            if self.q_lora:
                self.q_layernorm = norm(config.q_lora_rank, config.rms_norm_eps)
            self.kv_layernorm = norm(self.kv_rank, config.rms_norm_eps)
        self.linear_proj = linear(self.heads * self.v_dim, d)
        factor = config.rotary_scaling_factor if config.rope_type == "yarn" else 1.0
        mscale = _yarn_mscale(factor, config.mscale_all_dim)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_dim + self.pos_dim)

    def _queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if not self.q_lora:
            return self.linear_q_proj(x_BSD)
        q = self.linear_q_down_proj(x_BSD)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        return self.linear_q_up_proj(q)

    def forward(self, x_BSD, cos, sin, mask_B1SK, cache) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        q_BSHX = self._queries(x_BSD).view(b, s, self.heads, self.q_dim + self.pos_dim)
        latent, k_pos_BSP = self.linear_kv_down_proj(x_BSD).split(
            [self.kv_rank, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv_BSHX = self.linear_kv_up_proj(latent).view(b, s, self.heads, self.q_dim + self.v_dim)
        q_nope, q_pos = q_BSHX.transpose(1, 2).split([self.q_dim, self.pos_dim], dim=-1)
        k_nope, v_BHSV = kv_BSHX.transpose(1, 2).split([self.q_dim, self.v_dim], dim=-1)
        q_pos = _rotate_interleaved(q_pos, cos, sin)
        k_pos_B1SP = _rotate_interleaved(k_pos_BSP.unsqueeze(1), cos, sin)
        q_BHSX = torch.cat([q_nope, q_pos], dim=-1)
        k_BHSX = torch.cat([k_nope, k_pos_B1SP.expand(-1, self.heads, -1, -1)], dim=-1)
        if cache is not None:
            k_BHSX, v_BHSV = cache.update(k_BHSX, v_BHSV.contiguous(), self.layer_idx)
        scores = torch.matmul(q_BHSX, k_BHSX.transpose(2, 3)) * self.softmax_scale
        scores = scores.masked_fill(~mask_B1SK, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q_BHSX.dtype)
        out_BSX = torch.matmul(probs, v_BHSV).transpose(1, 2).reshape(b, s, -1)
        return self.linear_proj(out_BSX)
