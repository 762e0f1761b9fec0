"""MVMoEForCausalLM: a megatron_mvmoe checkpoint as a transformers model (trust_remote_code).

Legend: B batch, S query positions, K key positions, D hidden size, H attention heads,
G key/value groups, C head dim, T tokens (B*S).

Design choices:
- Imports only torch, transformers and its sibling files, which the exporter copies flat
  beside config.json: basic_layers.py (Linear, RMSNorm, SwiGLU), moe_layers.py (routers,
  experts, the MoE layers), mla_attention.py, and from megatron_mvmoe/functional/ routing.py,
  mixing.py and quantize.py: the routing, view mixing and BitNet math are the very functions
  the training layers call, not a re-derivation.
- Parameter names are Megatron-Core's under `model.` (`model.decoder.layers.<i>.mlp....`),
  with the LM head as `lm_head`: export and import are renames, bit for bit.
- Megatron's fused QKV ([G, H/G + 2, C] rows per group) stays fused: BitNet's absmean scale
  spans exactly the matrix Megatron quantizes.
- Megatron-LM's options (issue 36): QK layer norm (RMSNorm over each head's query and key,
  before RoPE), multi-latent attention (mla_attention.py), group-limited routing and the
  shared expert's sigmoid gate (moe_layers.py, basic_layers.py).
- A DynamicCache serves generate(); padding masks are honoured. Dropout never exists
  (the trainer uses none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .basic_layers import Linear, RMSNorm, bitnet_bits
from .configuration_mvmoe import MVMoEConfig
from .mla_attention import MLASelfAttention, mla_rope_cos_sin
from .moe_layers import build_mlp


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids_BS: torch.Tensor, head_dim: int, base: float):
    """Megatron's RotaryEmbedding (rotary_percent 1, not interleaved): cos, sin [B, 1, S, C]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=position_ids_BS.device) / head_dim))
    freqs_BSc = position_ids_BS.float().unsqueeze(-1) * inv_freq
    emb_BSC = torch.cat((freqs_BSc, freqs_BSc), dim=-1)
    return emb_BSC.cos().unsqueeze(1), emb_BSC.sin().unsqueeze(1)


class SelfAttention(nn.Module):
    """Megatron's SelfAttention: fused QKV in query-group order, RoPE, causal softmax."""

    def __init__(self, config: MVMoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.groups = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bits, norm = bitnet_bits(config), config.bitnet_input_norm
        qkv_rows = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = Linear(config.hidden_size, qkv_rows, bits, norm)
        self.linear_proj = Linear(self.heads * self.head_dim, config.hidden_size, bits, norm)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:  # Megatron's SelfAttention: per-head RMSNorm before RoPE
            self.q_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x_BSD, cos, sin, mask_B1SK, cache) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        per_group = self.heads // self.groups
        qkv = self.linear_qkv(x_BSD).view(b, s, self.groups, per_group + 2, self.head_dim)
        q_BHSC = qkv[:, :, :, :per_group].reshape(b, s, self.heads, -1).transpose(1, 2)
        k_BGSC = qkv[:, :, :, per_group].transpose(1, 2)
        v_BGSC = qkv[:, :, :, per_group + 1].transpose(1, 2)
        if self.q_layernorm is not None:
            q_BHSC, k_BGSC = self.q_layernorm(q_BHSC), self.k_layernorm(k_BGSC)
        q_BHSC = q_BHSC * cos + rotate_half(q_BHSC) * sin
        k_BGSC = k_BGSC * cos + rotate_half(k_BGSC) * sin
        if cache is not None:
            k_BGSC, v_BGSC = cache.update(k_BGSC, v_BGSC, self.layer_idx)
        k_BHKC = k_BGSC.repeat_interleave(per_group, dim=1)
        v_BHKC = v_BGSC.repeat_interleave(per_group, dim=1)
        scores = torch.matmul(q_BHSC, k_BHKC.transpose(2, 3)) / (self.head_dim ** 0.5)
        scores = scores.masked_fill(~mask_B1SK, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q_BHSC.dtype)
        out_BSX = torch.matmul(probs, v_BHKC).transpose(1, 2).reshape(b, s, -1)
        return self.linear_proj(out_BSX)


class DecoderLayer(nn.Module):
    def __init__(self, config: MVMoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attention = (MLASelfAttention(config, layer_idx, Linear, RMSNorm)
                               if config.multi_latent_attention
                               else SelfAttention(config, layer_idx))
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_idx)

    def forward(self, x_BSD, cos, sin, mask_B1SK, cache) -> torch.Tensor:
        x_BSD = x_BSD + self.self_attention(self.input_layernorm(x_BSD), cos, sin, mask_B1SK,
                                            cache)
        h_BSD = self.pre_mlp_layernorm(x_BSD)
        return x_BSD + self.mlp(h_BSD.reshape(-1, h_BSD.shape[-1])).view_as(h_BSD)


class Embedding(nn.Module):
    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)


class Decoder(nn.Module):
    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MVMoEPreTrainedModel(PreTrainedModel):
    config_class = MVMoEConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_cache_class = True

    def _init_weights(self, module):
        """Weights always come from the exported checkpoint; fresh ones get N(0, 0.02)."""
        for name, param in module.named_parameters(recurse=False):
            if name == "weight" and isinstance(module, RMSNorm):
                nn.init.ones_(param)
            elif name != "gate_scale":
                nn.init.normal_(param, 0.0, 0.02)


def attention_mask_B1SK(attention_mask_BK, b, s, k, past, device) -> torch.Tensor:
    """Causal (query i sees keys <= past + i) and padding (0 in attention_mask) mask."""
    query_pos_S1 = torch.arange(past, past + s, device=device).unsqueeze(1)
    causal_SK = torch.arange(k, device=device).unsqueeze(0) <= query_pos_S1
    mask = causal_SK.view(1, 1, s, k).expand(b, 1, s, k)
    if attention_mask_BK is not None:
        mask = mask & attention_mask_BK[:, None, None, -k:].bool()
    return mask


class MVMoEModel(MVMoEPreTrainedModel):
    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__(config)
        self.embedding = Embedding(config)
        self.decoder = Decoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, **kwargs):
        b, s = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=input_ids.device).expand(b, s)
        if self.config.multi_latent_attention:
            cos, sin = mla_rope_cos_sin(position_ids, self.config)
        else:
            cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        mask = attention_mask_B1SK(attention_mask, b, s, past + s, past, input_ids.device)
        x_BSD = self.embedding.word_embeddings(input_ids)
        for layer in self.decoder.layers:
            x_BSD = layer(x_BSD, cos, sin, mask, past_key_values)
        return self.decoder.final_layernorm(x_BSD), past_key_values


class MVMoEForCausalLM(MVMoEPreTrainedModel, GenerationMixin):
    def __init__(self, config: MVMoEConfig) -> None:
        super().__init__(config)
        self.model = MVMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embedding.word_embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, labels=None, logits_to_keep=0,
                **kwargs) -> CausalLMOutputWithPast:
        hidden_BSD, cache = self.model(input_ids, attention_mask, position_ids,
                                       past_key_values, use_cache)
        if logits_to_keep:
            hidden_BSD = hidden_BSD[:, -logits_to_keep:]
        logits = self.lm_head(hidden_BSD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
