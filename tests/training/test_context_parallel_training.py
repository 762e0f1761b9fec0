"""Context parallelism through the trainer (issue 22): CP=2 on 2 gloo ranks, fp32, trains
the same losses as CP=1 on one rank over the first steps, from the same saved initial
weights, for every MoE variant. Every part is the real one: the layout (parallel.py),
the CP core attention in the spec (models/specs.py), Megatron's batch split and RoPE slice,
the CP loss reduction (training/step.py) and Megatron's DDP over data x context parallel."""

import pytest

from harness import tiny_run, train
from textdata import build_token_dir

pytestmark = pytest.mark.timeout(600)

STEPS = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_token_dir(str(tmp_path_factory.mktemp("tokens")))


@pytest.mark.parametrize("preset", ["tiny_smoe", "tiny_latent", "tiny_multi_router",
                                    "tiny_multi_view", "tiny_mh_moe"])
def test_cp2_losses_equal_cp1(data_dir, tmp_path, preset):
    init = str(tmp_path / "init")
    train(tiny_run(data_dir, preset=preset, train_iters=0, eval_iters=0, save=init), 1)
    from_init = dict(preset=preset, train_iters=STEPS, eval_iters=0, load=init,
                     load_optimizer=False)
    reference = train(tiny_run(data_dir, **from_init), 1)["losses"]
    cp2 = train(tiny_run(data_dir, parallel={"cp": 2}, **from_init), 2)["losses"]
    assert len(cp2) == STEPS and reference[-1] < reference[0], reference
    assert max(abs(a - b) for a, b in zip(reference, cp2)) < 1e-4, (reference, cp2)


def test_cp_seq_length_not_divisible_is_refused():
    from megatron_mvmoe.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"layout.cp: seq_length 30 .* 2\*cp = 4"):
        ParallelLayout(cp=2).validate(2, seq_length=30)
    with pytest.raises(ValueError, match=r"tp\*pp\*cp = 1\*1\*2 = 2 does not divide"):
        ParallelLayout(cp=2).validate(3)
