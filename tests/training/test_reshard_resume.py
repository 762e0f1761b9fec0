"""Resume on another layout with the optimizer's fully_reshardable format: a step-4
checkpoint saved at PP=2 continues on one rank, and one saved at EP=2 (DP=2) continues at
EP=2 x PP=2 (4 ranks), with the losses of the uninterrupted run within 1e-4 (weights and
Adam moments carried across layouts).

Between EP=1 and EP>1 Megatron moves expert parameters between its dense and expert
optimizers, so moments cannot follow; the checkpoint loader then warns and restarts them."""

import os

import pytest

from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)


COMMON = dict(train_iters=8, eval_iters=0, ckpt_optimizer_format="fully_reshardable")


def _save_then_rewind(text_tokens, root, parallel, world):
    full = train(tiny_run(text_tokens, parallel=parallel, save=root, save_interval=4, **COMMON),
                 world)
    with open(os.path.join(root, "latest"), "w") as fh:  # resume from step 4
        fh.write("iter_0000004\n")
    return full


def test_pp2_checkpoint_continues_on_one_rank(text_tokens, tmp_path):
    root = str(tmp_path / "ck")
    full = _save_then_rewind(text_tokens, root, {"pp": 2}, 2)
    _assert_continues(text_tokens, root, full, {}, 1)


def test_ep2_checkpoint_continues_at_ep2_pp2(text_tokens, tmp_path):
    root = str(tmp_path / "ck")
    full = _save_then_rewind(text_tokens, root, {"ep": 2}, 2)
    _assert_continues(text_tokens, root, full, {"ep": 2, "pp": 2}, 4)


def _assert_continues(text_tokens, root, full, parallel, world):
    resumed = train(tiny_run(text_tokens, parallel=parallel, load=root, **COMMON), world)
    assert resumed["first_step"] == 5
    diffs = [abs(a - b) for a, b in zip(resumed["losses"], full["losses"][4:])]
    assert len(diffs) == 4 and max(diffs) < 1e-4, (parallel, resumed["losses"],
                                                   full["losses"][4:])
