"""--multi-latent-attention / --qk-layernorm through the trainer (issue 22, feature 3): the
flags reach Megatron's MLA config with Megatron-LM's defaults, and a tiny model of every
variant with MLA and QK norm trains (finite losses that go down on real text)."""

import pytest

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.config.mla_config import MVMoEMLATransformerConfig
from megatron_mvmoe.models.build import model_config, validate_run
from harness import tiny_run, train

MLA_EXTRA = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=32,
                 kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)


def test_flags_build_megatron_mla_config_with_megatron_lm_defaults():
    run = config_from_args(["--model-preset", "tiny_multi_view", "--multi-latent-attention",
                            "--qk-layernorm", "--q-lora-rank", "32", "--v-head-dim", "16",
                            "--rope-type", "rope", "--rotary-scaling-factor", "2"])
    assert run.model.extra == {"multi_latent_attention": True, "qk_layernorm": True,
                               "q_lora_rank": 32, "v_head_dim": 16, "rope_type": "rope",
                               "rotary_scaling_factor": 2.0}
    config = model_config(run)
    assert isinstance(config, MVMoEMLATransformerConfig) and config.moe_variant == "multi_view"
    # Megatron-LM's arguments.py defaults, not MLATransformerConfig's (kv 512, qk 128+64):
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim) == (32, 128, 64)
    assert config.rotary_base == run.model.rotary_base
    plain = model_config(config_from_args(["--model-preset", "tiny_smoe", "--qk-layernorm"]))
    assert not isinstance(plain, MVMoEMLATransformerConfig) and plain.qk_layernorm


@pytest.mark.parametrize("argv,message", [
    (["--kv-lora-rank", "16"], "model.extra.kv_lora_rank: .*multi_latent_attention is off"),
    (["--multi-latent-attention", "--num-query-groups", "2"],
     "model.num_query_groups: 2 KV groups with multi-latent attention"),
    (["--multi-latent-attention", "--bitnet"], "bitnet.enabled: MLA's down projections"),
    (["--multi-latent-attention", "--cache-mla-latents"],
     "--cache-mla-latents: not supported: MLA latent caching serves Megatron's inference"),
])
def test_refused_combinations_name_why_and_what_instead(argv, message):
    with pytest.raises(ValueError, match=message):
        validate_run(config_from_args(["--model-preset", "tiny_smoe"] + argv))


@pytest.mark.parametrize("variant", ["smoe", "latent", "multi_router", "multi_view", "mh_moe"])
def test_every_variant_trains_with_mla_and_qk_norm(text_tokens, variant):
    raw = tiny_run(text_tokens, preset=f"tiny_{variant}", train_iters=6)
    raw["model"]["extra"] = dict(MLA_EXTRA)
    losses = train(raw, world_size=1)["losses"]
    assert len(losses) == 6 and all(0 < loss < 10 for loss in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses
