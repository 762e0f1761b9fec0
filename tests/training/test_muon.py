"""Megatron-LM's Muon lines (--optimizer muon, --muon-*) train through Megatron-Core's own
get_megatron_optimizer (emerging-optimizers' Muon on 2-D weights, Adam on the rest), issue 36."""

from types import SimpleNamespace

import pytest
import torch

MUON_LINE = ["--model-preset", "tiny_smoe", "--optimizer", "muon", "--muon-momentum", "0.9",
             "--muon-extra-scale-factor", "0.2", "--muon-scale-mode", "spectral"]


def test_muon_flags_reach_megatron_core_optimizer_config_as_in_megatron_lm():
    """Megatron-LM passes --optimizer and every --muon-* flag to OptimizerConfig by name."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.training.build import optimizer_config

    run = config_from_args(MUON_LINE + ["--use-distributed-optimizer", "false"])
    got = optimizer_config(run, SimpleNamespace(bf16=False, params_dtype=torch.float32))
    assert (got.optimizer, got.muon_momentum, got.muon_extra_scale_factor,
            got.muon_scale_mode) == ("muon", 0.9, 0.2, "spectral")


@pytest.mark.parametrize("line", [MUON_LINE + ["--use-distributed-optimizer"],
                                  ["--model-preset", "tiny_smoe", "--optimizer", "dist_muon"]])
def test_muon_with_a_distributed_optimizer_is_refused_naming_the_fix(line):
    """Megatron-LM runs that as LayerWiseDistributedOptimizer, which is not wired here."""
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError, match="LayerWiseDistributedOptimizer.*without "
                                         "--use-distributed-optimizer"):
        config_from_args(line).validate()


def test_a_muon_run_trains_with_muon_and_resumes_exactly(tmp_path, text_tokens):
    """Muon's momentum buffers are in the checkpoint: a resume from step 2 repeats steps 3-4
    bit for bit; and the run is not Adam's (its losses differ from step 2 on)."""
    from harness import tiny_run, train

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=4, save_interval=2,
                   save=str(tmp_path / "ck"))
    raw["optimizer"].update(use_distributed_optimizer=False)
    adam = train(raw, 1)["losses"]
    raw["optimizer"].update(optimizer="muon", muon_extra_scale_factor=0.2)
    raw["training"].update(save=str(tmp_path / "muon"))
    full = train(raw, 1)["losses"]
    assert full[0] == adam[0] and full[1:] != adam[1:]
    raw["training"].update(load=str(tmp_path / "muon"), ckpt_step=2, save=str(tmp_path / "ck2"))
    assert train(raw, 1)["losses"] == full[2:]
