"""--fp16 (training.precision fp16) as in Megatron-LM: fp16 weights, fp32 main weights and
dynamic loss scaling by Megatron-Core's Float16OptimizerWithFloat16Params and
DynamicGradScaler, on CPU: from 2**32 the first steps overflow and are skipped (counted,
not an error); from a workable scale the losses follow fp32's. Megatron-LM's other loss-scale flags
(--loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis) reach Megatron-Core's
OptimizerConfig, and a static scale scales the gradients by exactly that factor."""

import pytest
import torch

from harness import tiny_run, train
from megatron_mvmoe.testing.spawn import run_distributed


def _raw(text_tokens, precision, **optimizer):
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=4, eval_iters=0,
                   precision=precision)
    raw["logging"]["log_interval"] = 1
    raw["optimizer"].update(optimizer)
    return raw


@pytest.mark.timeout(600)
def test_fp16_loss_scaling_skips_overflows_then_follows_fp32(text_tokens):
    from_2_32 = train(_raw(text_tokens, "fp16"), 1)
    assert from_2_32["skipped_iters"] == 4, from_2_32  # 2**32 overflows fp16's grads
    fp32 = train(_raw(text_tokens, "fp32"), 1)["losses"]
    fp16 = train(_raw(text_tokens, "fp16", initial_loss_scale=1024.0), 1)
    assert fp16["skipped_iters"] == 0, fp16
    assert fp16["losses"][-1] < fp16["losses"][0]  # the updates were applied
    assert fp16["losses"] == pytest.approx(fp32, abs=2e-2), (fp16["losses"], fp32)


def test_fp16_flags_reach_megatrons_configs():
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config

    run = config_from_args(["--model-preset", "tiny_smoe", "--fp16",
                            "--apply-query-key-layer-scaling", "--initial-loss-scale", "256"])
    config = model_config(run)
    assert run.training.precision == "fp16" and run.optimizer.initial_loss_scale == 256
    assert config.fp16 and not config.bf16 and str(config.params_dtype) == "torch.float16"
    assert config.apply_query_key_layer_scaling and config.attention_softmax_in_fp32


LOSS_SCALE_FLAGS = ["--loss-scale", "1024", "--min-loss-scale", "4", "--loss-scale-window",
                    "50", "--hysteresis", "3"]


def test_loss_scale_flags_reach_megatrons_optimizer_config():
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config
    from megatron_mvmoe.training.build import optimizer_config

    run = config_from_args(["--model-preset", "tiny_smoe", "--fp16", *LOSS_SCALE_FLAGS])
    o = optimizer_config(run, model_config(run))
    assert (o.loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis) == \
        (1024.0, 4.0, 50.0, 3)
    run = config_from_args(["--model-preset", "tiny_smoe", "--fp16"])
    bare = optimizer_config(run, model_config(run))  # Megatron-LM's parser defaults
    assert (bare.loss_scale, bare.initial_loss_scale, bare.min_loss_scale,
            bare.loss_scale_window, bare.hysteresis) == (None, 2.0 ** 32, 1.0, 1000, 2)


def _grads_of_one_backward(rank, world_size, raws):
    """Per raw config: the optimizer's loss scale and the gradients of one forward/backward
    through the trainer's own wiring (build_trainer sets config.grad_scale_func)."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.testing.gpt_harness import global_batch, train_step_losses_and_grads
    from megatron_mvmoe.training.build import build_trainer

    out = []
    for raw in raws:
        run = config_from_dict(raw)
        pgs = initialize_layout(run.parallel.layout()) if not out else pgs
        trainer = build_trainer(run, pgs)
        tokens = global_batch(4, run.model.seq_length, run.model.vocab_size)
        step = train_step_losses_and_grads(trainer.model[0], trainer.config, tokens, 2, pgs)
        out.append({"scale": float(trainer.optimizer.get_loss_scale()),
                    "grads": {k: v[0] for k, v in step["grads"].items()}})
    return out


@pytest.mark.timeout(300)
def test_a_static_loss_scale_scales_the_gradients_by_its_factor(text_tokens):
    """Megatron-Core's ConstantGradScaler under its mixed-precision optimizer (here fp32 with
    the distributed optimizer, so powers of two scale exactly): the gradients after the
    backward are 1024 x those of the same run without --loss-scale."""
    plain = _raw(text_tokens, "fp32", use_distributed_optimizer=True)
    scaled = _raw(text_tokens, "fp32", use_distributed_optimizer=True, loss_scale=1024.0)
    unscaled, by_1024 = run_distributed(_grads_of_one_backward, 1, timeout_s=240,
                                        args=([plain, scaled],))[0]
    assert (unscaled["scale"], by_1024["scale"]) == (1.0, 1024.0)
    assert set(unscaled["grads"]) == set(by_1024["grads"])
    for name, grad in unscaled["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(by_1024["grads"][name], grad * 1024, rtol=0, atol=0,
                                   msg=name)
