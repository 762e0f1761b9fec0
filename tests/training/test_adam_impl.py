"""optimizer.torch_adam_impl (training/adam_impl.py): torch AdamW's foreach/fused flags are
the run's, after the build and after a resume; torch's load_state_dict would otherwise take
them from the checkpoint's param groups."""

import copy

import pytest

from harness import tiny_run
from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.testing.spawn import run_distributed


def _adam_flags(trainer):
    from megatron_mvmoe.training.adam_impl import torch_adams

    return sorted({(g["foreach"], g["fused"]) for adam in torch_adams(trainer.optimizer)
                   for g in adam.param_groups}, key=str)


def _train_seeing_flags(rank, world, raw, write_flags):
    """pretrain; at each step's start, records the Adam groups' flags, and with
    `write_flags` first overwrites them (a checkpoint written under another implementation)."""
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(), timeout_s=60)
    seen = []

    def on_step(step, trainer):
        if write_flags is not None:
            from megatron_mvmoe.training.adam_impl import torch_adams

            for adam in torch_adams(trainer.optimizer):
                for group in adam.param_groups:
                    group["foreach"], group["fused"] = write_flags
        seen.append(_adam_flags(trainer))
    result = pretrain(run, pgs, on_step=on_step)
    return {"flags": seen, "losses": result.losses}


def _run(raw, write_flags=None):
    return run_distributed(_train_seeing_flags, 1, timeout_s=240, args=(raw, write_flags),
                           daemon=False)[0]


def _raw(tokens, impl=None, **training):
    raw = tiny_run(tokens, preset="tiny_smoe", eval_iters=0, **training)
    raw["optimizer"]["decay_iters"] = 10  # one schedule for the saved and the resumed runs
    if impl is not None:
        raw["optimizer"]["torch_adam_impl"] = impl
    return raw


def test_resume_runs_the_configured_adam_not_the_checkpoints(text_tokens, tmp_path, capfd):
    """A checkpoint whose param groups say foreach=True (written under another
    implementation): resumed with the default, torch's own choice runs (None, None); resumed
    with fused, fused runs, and the banner says it differs from a Megatron-LM line's."""
    root = str(tmp_path / "ck")
    _run(_raw(text_tokens, train_iters=2, save=root, save_interval=2), write_flags=(True, False))
    default = _run(_raw(text_tokens, train_iters=3, load=root))
    assert default["flags"] == [[(None, None)]]  # the old code kept the checkpoint's (True, False)
    capfd.readouterr()
    fused = _run(_raw(text_tokens, "fused", train_iters=3, load=root))
    assert fused["flags"] == [[(False, True)]]
    assert capfd.readouterr().out.count("adam: torch AdamW fused (optimizer.torch_adam_impl") == 1


def test_adam_impl_refuses_an_unknown_name(text_tokens):
    with pytest.raises(ValueError, match=r"optimizer\.torch_adam_impl"):
        config_from_dict(_raw(text_tokens, "fast"))


def test_every_configurable_impl_has_its_flags():
    """The config's choices (OptimizerSection's Literal) are IMPL_FLAGS' names, which the
    tools' --torch-adam-impl offer: a name added to one only would fail at the build."""
    import typing

    from megatron_mvmoe.config.run_sections import OptimizerSection
    from megatron_mvmoe.training.adam_impl import IMPL_FLAGS

    hint = typing.get_type_hints(OptimizerSection)["torch_adam_impl"]
    assert list(typing.get_args(hint)) == list(IMPL_FLAGS)

