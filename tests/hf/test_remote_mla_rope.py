"""The exported class's MLA RoPE (hf/remote/mla_attention.py, which may import nothing of
Megatron) equals Megatron-Core's RotaryEmbedding and YarnRotaryEmbedding, cos and sin with
the concentration factor, for plain RoPE and YaRN at factors 1, 4 (DeepSeek's mscale) and
40; tests/hf/test_export_equality.py checks the whole model at YaRN x2."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mvmoe.hf.remote.mla_attention import mla_rope_cos_sin
from megatron_mvmoe.platform.cpu_patches import apply_cpu_patches

DIM, BASE, SEQ, ORIGINAL = 8, 10000.0, 37, 16


@pytest.mark.parametrize("rope_type,factor,mscale,mscale_all_dim", [
    ("rope", 1.0, 1.0, 0.0), ("yarn", 1.0, 1.0, 0.0), ("yarn", 4.0, 0.707, 0.707),
    ("yarn", 40.0, 1.0, 0.0)])
def test_mla_rope_is_megatrons(rope_type, factor, mscale, mscale_all_dim):
    apply_cpu_patches()
    from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

    config = SimpleNamespace(qk_pos_emb_head_dim=DIM, rope_theta=BASE, rope_type=rope_type,
                             rotary_scaling_factor=factor, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=ORIGINAL, mscale=mscale,
                             mscale_all_dim=mscale_all_dim)
    cos, sin = mla_rope_cos_sin(torch.arange(SEQ).unsqueeze(0), config)
    if rope_type == "rope":
        emb, concentration = RotaryEmbedding(DIM, rotary_percent=1.0, rotary_base=BASE,
                                             use_cpu_initialization=True)(SEQ), 1.0
    else:
        emb, concentration = YarnRotaryEmbedding(
            DIM, rotary_base=BASE, scaling_factor=factor, original_max_position_embeddings=
            ORIGINAL, beta_fast=32.0, beta_slow=1.0, mscale=mscale,
            mscale_all_dim=mscale_all_dim, use_cpu_initialization=True)(SEQ)
    emb_SP = emb[:, 0, 0, :]
    torch.testing.assert_close(cos[0, 0], emb_SP.cos() * concentration, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, 0], emb_SP.sin() * concentration, rtol=0, atol=1e-6)
    if factor > 1:  # YaRN's frequencies and factor really differ from plain RoPE's here
        plain_cos, _ = mla_rope_cos_sin(torch.arange(SEQ).unsqueeze(0),
                                        SimpleNamespace(**dict(vars(config), rope_type="rope")))
        assert float((plain_cos - cos).abs().max()) > 1e-2
