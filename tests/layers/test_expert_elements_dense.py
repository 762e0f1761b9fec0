"""models.fast_paths.expert_matrix_elements on a model without routed experts: a dense
model may leave moe_ffn_hidden_size unset, which raised TypeError (None // etp) before;
now it is None ("no routed expert") and the fast-path choice and the transformer config
still build. MoE sections keep I x F, checked against a naive product."""

from __future__ import annotations

import dataclasses

from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.models import fast_paths as fp
from megatron_mvmoe.models.fast_paths import Target
from megatron_mvmoe.models.provider import transformer_config


def test_dense_model_has_no_expert_matrix_and_still_builds():
    dense = dataclasses.replace(model_from_preset("tiny_dense"), moe_ffn_hidden_size=None)
    assert fp.expert_matrix_elements(dense) is None
    assert fp.expert_matrix_elements(model_from_preset("tiny_dense")) is None
    path = next(p for p in fp.choose_fast_paths(Target(cuda=False, te=False), "dense",
                                                expert_elements=None)
                if p.name == "cpu_grouped_experts")
    assert not path.on and "dense model" in path.why
    config = transformer_config(dense, on_cpu=True)
    assert config.cpu_grouped_experts is False


def test_moe_sections_keep_their_input_width_times_ffn_width():
    for preset in ("tiny_multi_view", "tiny_latent", "tiny_mh_moe"):
        m = model_from_preset(preset)
        width = m.latent_size if m.is_latent else m.hidden_size // (
            m.multi_head.num_heads if m.moe_variant == "mh_moe" else 1)
        assert fp.expert_matrix_elements(m) == width * m.moe_ffn_hidden_size
        assert fp.expert_matrix_elements(m, etp=2) == width * (m.moe_ffn_hidden_size // 2)
