"""Expert capacity / token dropping and group-limited routing through the trainer (issue 22,
features 4 and 5): a tiny model of every variant trains with Megatron's capacity settings
(dropping, and padding to capacity) and with group-limited routing (finite losses that go
down on real text); MH-MoE routes its sub-tokens with Megatron's own TopKRouter, so both
apply to them unchanged."""

import pytest

from harness import tiny_run, train

VARIANTS = ["smoe", "latent", "multi_router", "multi_view", "mh_moe"]
SETTINGS = {
    "drop": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    "pad": dict(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="position"),
    "groups": dict(moe_router_num_groups=2, moe_router_group_topk=1),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_with_capacity_and_group_limited_routing(text_tokens, variant,
                                                                      setting):
    raw = tiny_run(text_tokens, preset=f"tiny_{variant}", train_iters=6)
    raw["model"]["extra"] = dict(SETTINGS[setting])
    losses = train(raw, world_size=1)["losses"]
    assert len(losses) == 6 and all(0 < loss < 10 for loss in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses


def test_megatron_lm_flags_reach_the_config():
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config

    run = config_from_args(["--model-preset", "tiny_multi_view",
                            "--moe-expert-capacity-factor", "1.25",
                            "--moe-pad-expert-input-to-capacity",
                            "--moe-token-drop-policy", "position",
                            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"])
    assert run.model.extra == {"moe_expert_capacity_factor": 1.25,
                               "moe_pad_expert_input_to_capacity": True,
                               "moe_token_drop_policy": "position",
                               "moe_router_num_groups": 2, "moe_router_group_topk": 1}
    config = model_config(run)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity,
            config.moe_token_drop_policy, config.moe_router_num_groups,
            config.moe_router_group_topk) == (1.25, True, "position", 2, 1)


@pytest.mark.parametrize("argv, message", [
    (["--moe-token-drop-policy", "random"],
     "--moe-token-drop-policy: 'random' is not one of probs, position"),
    (["--moe-pad-expert-input-to-capacity"],
     "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"),
    (["--moe-router-group-topk", "1"], "moe_router_num_groups must be specified"),
])
def test_bad_capacity_and_group_flags_are_one_line(argv, message):
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config

    with pytest.raises(ValueError, match=message) as err:
        model_config(config_from_args(["--model-preset", "tiny_multi_router"] + argv))
    assert "\n" not in str(err.value)
