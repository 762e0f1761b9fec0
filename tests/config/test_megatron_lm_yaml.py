"""Run-config YAML as users write it: 3e-3 is a number, a duplicated key is refused, and any
field the YAML or the preset sets can be dropped from the command line (--unset)."""

import pytest

from megatron_mvmoe.config.run_config import read_yaml


def test_exponent_numbers_read_as_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 3e-3\n  min_lr: 1.0e-5\n  adam_eps: -2E+1\n"
                    "data:\n  split: 969,30,1\n")
    raw = read_yaml(str(path))
    assert raw["optimizer"] == {"lr": 3e-3, "min_lr": 1e-5, "adam_eps": -20.0}
    assert raw["data"]["split"] == "969,30,1"  # stays a string


def test_duplicated_key_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 1e-3\n  min_lr: 0\n  lr: 2e-3\n")
    with pytest.raises(ValueError, match=r"key 'lr' given twice \(lines 2 and 4\)"):
        read_yaml(str(path))


# --- every YAML / preset field droppable from the command line: --unset section.field
def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_unset_vocab_size_takes_the_tokenizers_vocabulary(tmp_path):
    """The YAML's vocab_size is below the tokenizer's: the error names --unset, and with it
    the vocabulary is the tokenizer's, padded as Megatron-LM pads it."""
    from textdata import VOCAB, build_megatron_prefixes

    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.data.run_data import resolve_tokenizer

    data = build_megatron_prefixes(str(tmp_path / "data"))
    config = _yaml(tmp_path, "model:\n  preset: tiny_multi_view\n  vocab_size: 300\n")
    line = ["--config", config, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", data["tokenizer"], "--data-path", data["tech"]]
    with pytest.raises(ValueError, match=r"model.vocab_size: 300 is below the tokenizer's "
                                         r"512\. Fix: .*--unset model\.vocab_size"):
        resolve_tokenizer(config_from_args(line))
    run = config_from_args(line + ["--unset", "model.vocab_size"])
    assert run.model.vocab_size is None  # neither the YAML's 300 nor the preset's 4096
    resolve_tokenizer(run)
    assert run.model.vocab_size == VOCAB == 512  # 512 padded to a multiple of 128


def test_unset_reaches_preset_values_section_defaults_and_extra(tmp_path):
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.config.run_config import TrainingSection

    config = _yaml(tmp_path, "model:\n  preset: tiny_multi_view\n  extra:\n"
                   "    moe_aux_loss_coeff: 0.5\ntraining:\n  save_interval: 7\n"
                   "  save: /tmp/x\n")
    kept = config_from_args(["--config", config])
    assert kept.training.save_interval == 7 and kept.model.extra["moe_aux_loss_coeff"] == 0.5
    run = config_from_args(["--config", config, "--unset", "training.save_interval",
                            "--unset", "training.save", "--unset",
                            "model.extra.moe_aux_loss_coeff", "--vocab-size", "4096"])
    assert run.training.save_interval == TrainingSection.save_interval == 0
    assert run.training.save is None
    assert "moe_aux_loss_coeff" not in run.model.extra


@pytest.mark.parametrize("path, message", [
    ("model.vocab_sise", r"--unset model\.vocab_sise: no field 'vocab_sise' in model\. "
                         r"Fix: use one of .*model\.vocab_size"),
    ("modle.vocab_size", r"no section or field 'modle' in run config"),
    ("model.multi_view", r"is a section, not a field\. Fix: unset its fields"),
    ("model.extra.moe_z_loss_coeff", r"'moe_z_loss_coeff' is not set in model\.extra"),
])
def test_unset_of_a_wrong_path_is_one_line(path, message):
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError, match=message) as err:
        config_from_args(["--model-preset", "tiny_multi_view", "--unset", path])
    assert "\n" not in str(err.value)


def test_unset_and_a_flag_for_the_same_field_are_refused_together():
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError, match=r"--unset model\.vocab_size: --vocab-size sets it on "
                                         r"the same line\. Fix: keep one of them"):
        config_from_args(["--model-preset", "tiny_multi_view", "--vocab-size", "512",
                          "--unset", "model.vocab_size"])
