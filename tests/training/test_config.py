"""Run config: YAML + Megatron-style flag overrides, and errors that name field and fix."""

import pytest

from megatron_mvmoe.models.presets import resolve_model
from megatron_mvmoe.training.config import ModelSection, config_from_dict, load_yaml
from megatron_mvmoe.training.flags import config_from_args


def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny_smoe}\nparallel: {ep: 2}\n"
                    "training: {train_iters: 50, global_batch_size: 8}\n")
    run = config_from_args(["--config", str(path), "--train-iters", "7",
                            "--expert-model-parallel-size", "1", "--num-experts", "8",
                            "--moe-variant", "multi_view", "--num-routers", "2",
                            "--gamma-ramp-steps", "5", "--lr", "0.01", "--save", "/x"])
    assert run.training.train_iters == 7 and run.parallel.ep == 1
    assert run.training.global_batch_size == 8 and run.optimizer.lr == 0.01
    shape = resolve_model(run.model)
    assert (shape.num_experts, shape.moe_variant, shape.num_routers) == (8, "multi_view", 2)
    assert shape.num_views == 2  # R = K follows the routers
    assert shape.hidden_size == 64  # untouched preset field


def test_example_yaml_loads():
    run = load_yaml("examples/tiny_cpu.yaml")
    assert resolve_model(run.model).moe_variant == "multi_view"
    run.validate(world_size=2, num_layers=2, num_experts=4)


def test_unknown_field_named():
    with pytest.raises(ValueError, match=r"training: unknown field\(s\) \['trian_iters'\]"):
        config_from_dict({"training": {"trian_iters": 3}})


def test_unknown_preset_named():
    with pytest.raises(ValueError, match="model.preset: unknown preset 'nope'"):
        resolve_model(ModelSection(preset="nope"))


def test_layout_that_does_not_divide():
    run = config_from_dict({"parallel": {"tp": 2, "pp": 2}})
    with pytest.raises(ValueError, match=r"tp\*pp = 2\*2 = 4 does not divide world size 6"):
        run.validate(world_size=6)
    run = config_from_dict({"parallel": {"ep": 2}})
    with pytest.raises(ValueError, match="num_moe_experts 3 is not divisible by ep 2"):
        run.validate(world_size=2, num_layers=2, num_experts=3)


def test_batch_that_does_not_divide():
    run = config_from_dict({"training": {"global_batch_size": 6, "micro_batch_size": 2}})
    with pytest.raises(ValueError, match="training.global_batch_size: 6 is not divisible"):
        run.validate(world_size=2)


def test_warmup_longer_than_decay():
    run = config_from_dict({"optimizer": {"warmup_iters": 50}, "training": {"train_iters": 10}})
    with pytest.raises(ValueError, match="optimizer.warmup_iters"):
        run.validate()
