"""Run-config YAML as users write it: 3e-3 is a number, a duplicated key is refused."""

import pytest

from megatron_mvmoe.run_config import read_yaml


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
