"""Run config: YAML + Megatron-style flag overrides, and errors that name field and fix."""

import pytest
from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.config.run_config import config_from_dict, load_yaml


def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny_smoe}\nparallel: {ep: 2}\n"
                    "training: {train_iters: 50, global_batch_size: 8}\n")
    run = config_from_args(["--config", str(path), "--train-iters", "7",
                            "--expert-model-parallel-size", "1", "--num-experts", "8",
                            "--moe-variant", "multi_view", "--num-routers", "2", "--latent-size", "32",
                            "--gamma-ramp-steps", "5", "--lr", "0.01", "--save", "/x"])
    assert run.training.train_iters == 7 and run.parallel.ep == 1
    assert run.training.global_batch_size == 8 and run.optimizer.lr == 0.01
    model = run.model
    assert (model.num_experts, model.moe_variant, model.multi_view.num_routers) == (
        8, "multi_view", 2)
    assert model.multi_view.num_views == 2  # R = K follows the routers
    assert model.multi_view.gamma_ramp_steps == 5
    assert model.hidden_size == 64  # untouched preset field


def test_example_yaml_loads():
    run = load_yaml("examples/tiny_cpu.yaml")
    assert run.model.moe_variant == "multi_view"
    run.validate(world_size=2, num_layers=2, num_experts=4)


def test_unknown_field_named():
    with pytest.raises(ValueError, match=r"training: unknown field\(s\) \['trian_iters'\]"):
        config_from_dict({"training": {"trian_iters": 3}})


def test_unknown_preset_named():
    with pytest.raises(ValueError, match="model.preset: unknown preset 'nope'"):
        model_from_preset("nope")


def test_every_preset_of_both_families_is_one_model_preset_away():
    """One registry: the seed-2 family is chosen by --model-preset like ours, and its run
    config's model is the family's own model mapping (the parity tool's numbers)."""
    from megatron_mvmoe.config.presets import preset_names
    from megatron_mvmoe.config.seed2_presets import family_names, get_preset

    names = preset_names()
    assert {"tiny_multi_view", "mvmoe_10b_a1b"} <= set(names)
    assert {f"seed2_{n}" for n in family_names()} <= set(names)
    assert {f"seed2_tiny_{n}" for n in family_names()} <= set(names)
    run = config_from_args(["--model-preset", "seed2_tiny_mh_moe_h3", "--train-iters", "2"])
    expected = get_preset("mh_moe_h3", size="tiny").model_fields()
    assert (run.model.moe_variant, run.model.multi_head.num_heads, run.model.num_experts,
            run.model.hidden_size, run.model.extra) == (
        "mh_moe", 3, expected["num_experts"], 96, expected["extra"])
    with pytest.raises(ValueError, match=r"model\.preset: unknown preset 'seed2_nope'.*"
                       r"seed2_tiny_smoe_shared.*tiny_smoe"):
        config_from_args(["--model-preset", "seed2_nope"])


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


def test_multi_view_and_bitnet_switches_reach_the_layer_config():
    from megatron_mvmoe.models.build import model_config

    run = config_from_args(["--model-preset", "tiny_multi_view", "--stop-grad-mixing",
                            "--learned-gate-scale", "--gate-scale", "2.5",
                            "--multi-view-kernels", "reference", "--bitnet",
                            "--warm-start-from", "/ckpt", "--warm-start-new-heads", "copy"])
    config = model_config(run)
    mv = config.multi_view
    assert (mv.stop_grad_mixing, mv.learned_gate_scale, mv.gate_scale, mv.kernels) == (
        True, True, 2.5, "reference")
    assert config.bitnet.enabled
    assert (run.training.warm_start_from, run.training.warm_start_new_heads) == ("/ckpt", "copy")
    defaults = model_config(config_from_args(["--model-preset", "tiny_multi_view",
                                              "--stop-grad-mixing", "false"]))
    assert not defaults.multi_view.stop_grad_mixing and not defaults.bitnet.enabled
    assert defaults.multi_view.kernels == "auto" and defaults.multi_view.gate_scale == 1.0


@pytest.mark.parametrize("argv,match", [
    (["--multi-view-kernels", "cuda"], r"^model\.multi_view\.kernels: unknown 'cuda'\. Fix: use one of auto, triton, "
     "reference"),
    (["--gate-scale", "0"], r"^model\.multi_view\.gate_scale: must be > 0"),
    (["--warm-start-new-heads", "clone"], r"training.warm_start_new_heads: unknown 'clone'"),
])
def test_switch_errors_name_the_field(argv, match):
    with pytest.raises(ValueError, match=match):
        config_from_args(["--model-preset", "tiny_multi_view", *argv])


def test_help_documents_every_flag():
    from megatron_mvmoe.config.flags import FLAGS, build_parser

    text = build_parser().format_help()
    for flag in FLAGS:
        assert flag.name in text and f"[{flag.section}.{flag.field}]" in text, flag.name


@pytest.mark.parametrize("yaml_text,match", [
    ("training: {exit_on_nonfinite: 'false'}",
     r"^training\.exit_on_nonfinite: expected true/false, got 'false'\. Fix: write true/false "
     r"\(without quotes\)$"),
    ("training: {save: ''}", r"^training\.save: empty string\. Fix: omit the field or write null"),
    ("training: {train_iters: ten}", r"^training\.train_iters: expected an integer, got 'ten'"),
    ("training: {train_iters: true}", r"^training\.train_iters: expected an integer, got True"),
    ("model: {num_experts: 4.5}", r"^model\.num_experts: expected an integer, got 4\.5"),
    ("optimizer: {lr: '1e-3'}", r"^optimizer\.lr: expected a number, got '1e-3'"),
    ("model: {extra: {moe_aux_los_coeff: 0.1}}",
     r"^model\.extra: unknown MVMoETransformerConfig field\(s\) \['moe_aux_los_coeff'\]"),
    ("data: {train_blend: [a, b]}", r"^data\.train_blend: expected a mapping"),
    ("training: 5", r"^training: expected a mapping of fields, got 5"),
], ids=["bool-string", "empty-save", "int-string", "int-bool", "int-float", "float-string",
        "extra-key", "dict-list", "section-scalar"])
def test_wrong_yaml_types_name_the_field(tmp_path, yaml_text, match):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ValueError, match=match) as info:
        load_yaml(str(path))
    assert "\n" not in str(info.value)


def test_valid_yaml_types_pass_and_ints_widen_to_floats(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {lr: 1}\ntraining: {save: null, exit_on_nonfinite: false}\n"
                    "model: {extra: {moe_aux_loss_coeff: 0.01}}\n")
    run = load_yaml(str(path))
    assert run.optimizer.lr == 1.0 and isinstance(run.optimizer.lr, float)
    assert run.training.save is None and run.training.exit_on_nonfinite is False


def test_every_example_yaml_passes_the_type_checks():
    import pathlib

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    paths = sorted(examples.rglob("*.yaml"))  # anchored: from any working directory
    assert paths, f"no example YAML under {examples}"
    for path in paths:
        load_yaml(str(path))


@pytest.mark.parametrize("raw,match", [
    ({"training": {"precision": "fp8"}},
     r"^training\.precision: unknown 'fp8'\. Fix: use one of auto, bf16, fp16, fp32$"),
    ({"data": {"loader": "ray"}}, r"^data\.loader: unknown 'ray'\. Fix: use one of torch, dali$"),
    ({"optimizer": {"lr_decay_style": "step"}},
     r"^optimizer\.lr_decay_style: unknown 'step'\. Fix: use one of cosine, linear, constant, "
     r"inverse-square-root$"),
    ({"model": {"preset": "tiny_smoe", "moe_variant": "moe"}},
     r"^model\.moe_variant: unknown 'moe'\. Fix: use one of dense, smoe, latent, multi_router, "
     r"multi_view, mh_moe$"),
])
def test_literal_fields_name_the_field_and_the_allowed_values(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw)


def test_literal_fields_set_in_code_are_checked_at_validate():
    run = config_from_dict({"model": {"preset": "tiny_smoe"}})
    run.validate()
    run.training.ckpt_optimizer_format = "sharded"
    with pytest.raises(ValueError, match=r"^training\.ckpt_optimizer_format: unknown 'sharded'"):
        run.validate()
    run.training.ckpt_optimizer_format = "fully_reshardable"
    run.model.multi_view.kernels = "cuda"
    with pytest.raises(ValueError, match=r"^model\.multi_view\.kernels: unknown 'cuda'"):
        run.validate()


def test_flag_help_is_the_fields_docstring():
    """The flag table restates no docstring: the help of a flag that sets a modelled field
    is that field's attribute docstring (read from the source), plus the flag's note."""
    import dataclasses
    from typing import Optional

    from megatron_mvmoe.config.field_docs import doc_of, field_docs
    from megatron_mvmoe.config.flags import FLAGS, flag_help
    from megatron_mvmoe.config.run_config import RunConfig

    @dataclasses.dataclass
    class Inner:
        width: int = 1
        """How wide
        it is."""
        undocumented: Optional[int] = None

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        """The inner part."""

    assert field_docs(Outer) == {"inner": "The inner part."}
    assert (doc_of(Outer, "inner.width"), doc_of(Outer, "inner.undocumented"),
            doc_of(Outer, "inner.nope.x")) == ("How wide it is.", None, None)
    modelled = [f for f in FLAGS if f.const is None and not f.field.startswith("extra.")]
    assert len(modelled) > 80
    for flag in modelled:
        doc = doc_of(RunConfig, f"{flag.section}.{flag.field}")
        assert doc, f"{flag.name}: [{flag.section}.{flag.field}] has no docstring"
        assert flag_help(flag).startswith(doc.rstrip(".").replace("%", "%%")), flag.name
    assert doc_of(RunConfig, "model.multi_view.num_routers").startswith("R: sigmoid routing")
    assert "[model.extra.moe_aux_loss_coeff]" in flag_help(
        next(f for f in FLAGS if f.name == "--moe-aux-loss-coeff"))


_COUNT_BUILDS = """
import sys
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.training.pretrain import main
builds, original = [], MVMoETransformerConfig.__post_init__
def counted(self):
    builds.append(1)
    original(self)
MVMoETransformerConfig.__post_init__ = counted
status = main(sys.argv[1:])
print(f"BUILDS {len(builds)} STATUS {status}")
"""


def test_a_launch_builds_and_validates_the_megatron_config_once(tmp_path):
    """validate_run's config is the one the model is built with (it was built 4 times)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29647", OMP_NUM_THREADS="1")
    argv = ["--model-preset", "tiny_smoe", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "4096", "--seq-length", "64", "--train-iters", "1",
            "--global-batch-size", "2", "--micro-batch-size", "2", "--eval-iters", "0",
            "--eval-interval", "0", "--tensorboard", "false"]
    done = subprocess.run([sys.executable, "-c", _COUNT_BUILDS, *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert "BUILDS 1 STATUS 0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_yaml_syntax_error_is_one_line_naming_file_line_and_fix(tmp_path, capsys):
    """A tab in the indentation was a 150-line PyYAML traceback; now the trainer exits 2
    with one line naming the file, line, column and the fix."""
    from megatron_mvmoe.training.pretrain import main

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny_smoe\ntraining:\n\ttrain_iters: 5\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: --config {path}, line 4, column 1: not valid YAML (while scanning for the "
        "next token found character '\\t' that cannot start any token). Fix: indent with "
        "spaces: YAML does not allow tabs there"], err
