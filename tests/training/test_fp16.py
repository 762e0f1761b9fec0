"""--fp16 (training.precision fp16) as in Megatron-LM: fp16 weights, fp32 main weights and
dynamic loss scaling by Megatron-Core's Float16OptimizerWithFloat16Params and
DynamicGradScaler, on CPU: from 2**32 the first steps overflow and are skipped (counted,
not an error); from a workable scale the losses follow fp32's."""

import pytest

from harness import tiny_run, train


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
