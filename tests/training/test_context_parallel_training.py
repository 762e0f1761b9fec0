"""Context parallelism through the trainer (issue 22): CP=2 on 2 gloo ranks, fp32, trains
the same losses as CP=1 on one rank over the first steps, from the same saved initial
weights, for every MoE variant; and at world 4 beside TP=2 (SP) x EP=2, EP=2 x DP=2 and
PP=2 x EP=2. Every part is the real one: the layout (parallel.py), the CP core attention in the
spec (models/specs.py), Megatron's batch split and RoPE slice, the CP loss reduction
(training/step.py) and Megatron's DDP over data x context parallel. Gradients of the same
layouts: tests/layers/test_context_parallel_layouts.py. Checkpoints reshard between CP
sizes (save at CP=2, continue at CP=1, and back)."""

import pytest

from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)

STEPS = 4


@pytest.fixture(scope="module")
def one_rank(text_tokens, tmp_path_factory):
    """preset -> (run settings from its saved initial weights, CP=1 one-rank losses)."""
    cache = {}

    def get(preset):
        if preset not in cache:
            init = str(tmp_path_factory.mktemp(f"init_{preset}"))
            train(tiny_run(text_tokens, preset=preset, train_iters=0, eval_iters=0, save=init), 1)
            from_init = dict(preset=preset, train_iters=STEPS, eval_iters=0, load=init,
                             load_optimizer=False)
            cache[preset] = from_init, train(tiny_run(text_tokens, **from_init), 1)["losses"]
        return cache[preset]
    return get


def _assert_same_losses(reference, other):
    assert len(other) == STEPS and reference[-1] < reference[0], reference
    assert max(abs(a - b) for a, b in zip(reference, other)) < 1e-4, (reference, other)


@pytest.mark.parametrize("preset", ["tiny_smoe", "tiny_latent", "tiny_multi_router",
                                    "tiny_multi_view", "tiny_mh_moe"])
def test_cp2_losses_equal_cp1(text_tokens, one_rank, preset):
    from_init, reference = one_rank(preset)
    _assert_same_losses(reference, train(tiny_run(text_tokens, parallel={"cp": 2}, **from_init),
                                         2)["losses"])


@pytest.mark.parametrize("preset,parallel", [
    ("tiny_mh_moe", {"cp": 2, "tp": 2, "ep": 2}), ("tiny_smoe", {"cp": 2, "tp": 2, "ep": 2}),
    ("tiny_multi_view", {"cp": 2, "tp": 2, "ep": 2}), ("tiny_multi_view", {"cp": 2, "ep": 2}),
    ("tiny_multi_view", {"cp": 2, "pp": 2, "ep": 2})],
    ids=["mh_moe-cp2_tp2_ep2", "smoe-cp2_tp2_ep2", "multi_view-cp2_tp2_ep2",
         "multi_view-cp2_ep2_dp2", "multi_view-cp2_pp2_ep2"])
def test_cp2_with_tp_ep_dp_losses_equal_one_rank(text_tokens, one_rank, preset, parallel):
    from_init, reference = one_rank(preset)
    _assert_same_losses(reference, train(tiny_run(text_tokens, parallel=parallel, **from_init),
                                         4)["losses"])


def test_cp_seq_length_not_divisible_is_refused():
    from megatron_mvmoe.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"layout.cp: seq_length 30 .* 2\*cp = 4"):
        ParallelLayout(cp=2).validate(2, seq_length=30)
    with pytest.raises(ValueError, match=r"tp\*pp\*cp = 1\*1\*2 = 2 does not divide"):
        ParallelLayout(cp=2).validate(3)


RESHARD = dict(train_iters=8, eval_iters=0, ckpt_optimizer_format="fully_reshardable")


@pytest.mark.parametrize("saved_cp,resumed_cp", [(2, 1), (1, 2)], ids=["cp2_to_cp1", "cp1_to_cp2"])
def test_checkpoint_reshards_between_cp_sizes(text_tokens, tmp_path, saved_cp, resumed_cp):
    """A step-4 checkpoint saved at one CP size continues at the other: steps 5..8 give the
    uninterrupted run's losses within 1e-4. The weights are whole on every CP rank, but
    Megatron's distributed optimizer shards the Adam moments over DP x CP, so they are
    resharded 2 -> 1 and 1 -> 2 (the fully_reshardable format)."""
    import os

    root = str(tmp_path / "ck")
    full = train(tiny_run(text_tokens, parallel={"cp": saved_cp}, save=root, save_interval=4,
                          **RESHARD), saved_cp)
    with open(os.path.join(root, "latest"), "w") as fh:  # resume from step 4
        fh.write("iter_0000004\n")
    resumed = train(tiny_run(text_tokens, parallel={"cp": resumed_cp}, load=root, **RESHARD),
                    resumed_cp)
    assert resumed["first_step"] == 5
    diffs = [abs(a - b) for a, b in zip(resumed["losses"], full["losses"][4:])]
    assert len(diffs) == 4 and max(diffs) < 1e-4, (resumed["losses"], full["losses"][4:])
