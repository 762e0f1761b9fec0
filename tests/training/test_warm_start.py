"""Warm start (--warm-start-from): a trained tiny latent baseline initialises a tiny
Multi-View R = 2 model; with new_heads=copy and gamma = 0 at step 0 its first-step loss is
the baseline's loss on the same batch. Incompatible baselines fail naming the field."""

import pytest

from megatron_mvmoe.testing.spawn import DistributedTestError
from harness import tiny_run, train

pytestmark = pytest.mark.timeout(300)


def run(text_tokens, preset, **training):
    """A tiny run without LR warmup (runs of one step), no final evaluation."""
    raw = tiny_run(text_tokens, preset=preset, eval_iters=0, **training)
    raw["optimizer"]["warmup_iters"] = 0
    return raw


@pytest.fixture(scope="module")
def baseline(text_tokens, tmp_path_factory):
    """A tiny latent baseline trained 3 steps and saved (its Adam state included)."""
    root = str(tmp_path_factory.mktemp("baseline"))
    train(run(text_tokens, "tiny_latent", train_iters=3, save=root), 1)
    return root


def test_copy_heads_first_step_equals_baseline(text_tokens, baseline, tmp_path):
    # The baseline's own loss on batch 1 at its saved weights (--finetune: weights only).
    reference = train(run(text_tokens, "tiny_latent", train_iters=1, load=baseline,
                          finetune=True), 1)["losses"][0]
    # One command line for launch and relaunch: --load without a checkpoint yet -> warm
    # start; once the run has saved, the same command resumes it instead.
    command = dict(warm_start_from=baseline, warm_start_new_heads="copy",
                   save=str(tmp_path / "mv"), load=str(tmp_path / "mv"))
    warm = train(run(text_tokens, "tiny_multi_view", train_iters=2, **command), 1)
    assert warm["first_step"] == 1
    assert abs(warm["losses"][0] - reference) < 1e-5, (warm["losses"], reference)
    relaunch = train(run(text_tokens, "tiny_multi_view", train_iters=3, **command), 1)
    assert relaunch["first_step"] == 3
    # A fresh Multi-View model is far from the trained baseline: the check can fail.
    fresh = train(run(text_tokens, "tiny_multi_view", train_iters=1), 1)["losses"][0]
    assert abs(fresh - reference) > 0.1, (fresh, reference)


def test_bf16_warm_start_keeps_the_weights_after_the_first_step(text_tokens, baseline):
    """bf16 keeps fp32 main copies in the optimizer; unless the warm start refreshes them,
    the first optimizer step writes the initial weights back (step 2 loss ~ init's)."""
    kwargs = dict(train_iters=2, warm_start_from=baseline, warm_start_new_heads="copy")
    fp32 = train(run(text_tokens, "tiny_multi_view", **kwargs), 1)["losses"]
    bf16 = train(run(text_tokens, "tiny_multi_view", precision="bf16", **kwargs), 1)["losses"]
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.05, (fp32, bf16)


def test_incompatible_baseline_names_field(text_tokens, baseline):
    raw = run(text_tokens, "tiny_multi_view", train_iters=1, warm_start_from=baseline)
    raw["model"]["latent_size"] = 16
    with pytest.raises(DistributedTestError, match=r"baseline does not fit this model; "
                                                   r"latent_size: checkpoint 32 vs this run 16"):
        train(raw, 1)


def test_non_router_target_refused(text_tokens, baseline):
    raw = run(text_tokens, "tiny_smoe", train_iters=1, warm_start_from=baseline)
    with pytest.raises(DistributedTestError, match=r"model.moe_variant is 'smoe'.*Fix: use "
                                                   r"--moe-variant multi_view"):
        train(raw, 1)
