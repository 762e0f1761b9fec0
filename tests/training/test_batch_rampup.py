"""--rampup-batch-size START INCR SAMPLES (issue 22, feature 8): Megatron's num-microbatches
calculator gives each step's global batch from the consumed samples, with Megatron-LM's
ramp (checked against the formula of Megatron's former ramp-up calculator written out
naively); the trainer consumes exactly those samples, and a resume mid-ramp (consumed
samples from the checkpoint) equals the uninterrupted run bit for bit."""

import json
import os

import pytest

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.data.batch_rampup import batch_calculator, ramp_batches, rampup_schedule
from harness import tiny_run, train


def _naive_ramp(start, incr, samples, global_batch, steps):
    """Megatron-LM's ramp as its old RampupBatchsizeNumMicroBatchesCalculator computed it."""
    increments = (global_batch - start) // incr
    per_increment = samples / increments
    consumed, out = 0, []
    for _ in range(steps):
        grown = int(consumed / per_increment) if consumed <= samples else increments
        out.append(min(global_batch, start + grown * incr))
        consumed += out[-1]
    return out


@pytest.mark.parametrize("ramp,global_batch", [((2, 2, 16), 8), ((2, 2, 2), 8),
                                               ((4, 4, 100), 32), ((16, 16, 1000), 256),
                                               ((3, 6, 50), 27)])
def test_ramp_follows_megatron_lm(ramp, global_batch):
    assert ramp_batches(ramp, global_batch, 60) == _naive_ramp(*ramp, global_batch, 60)


def test_calculator_gives_microbatches_of_each_step():
    calc = batch_calculator([4, 4, 24], 16, micro_batch_size=2, data_parallel_size=2)
    assert rampup_schedule([4, 4, 24], 16) == "0:4 8:8 16:12 24:16"
    seen = []
    for consumed in (0, 7, 8, 16, 24, 1000):
        calc.update(consumed, consistency_check=True)
        seen.append((calc.get_current_global_batch_size(), calc.get()))
    assert seen == [(4, 1), (4, 1), (8, 2), (12, 3), (16, 4), (16, 4)]


@pytest.mark.parametrize("argv,message", [
    (["--rampup-batch-size", "3", "2", "16"], "training.rampup_batch_size: global batch 8 - "
                                              "START 3 is not a multiple of INCR 2"),
    (["--rampup-batch-size", "0", "2", "16"], "1 <= START <= --global-batch-size"),
])
def test_bad_ramp_is_one_line(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(["--model-preset", "tiny_smoe", "--global-batch-size", "8"] + argv)


def test_ramp_not_divisible_by_microbatches_names_the_fix():
    run = config_from_args(["--model-preset", "tiny_smoe", "--global-batch-size", "8",
                            "--micro-batch-size", "2", "--rampup-batch-size", "1", "1", "8"])
    with pytest.raises(ValueError, match=r"START 1 and INCR 1 must be multiples of "
                                         r"micro_batch_size \* data-parallel size = 2"):
        run.validate(world_size=1)


def _batches(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    train_rows = [r for r in rows if r.get("kind", "train") == "train" and "loss" in r]
    return [(r["step"], r["global_batch_size"], r["consumed_samples"]) for r in train_rows]


def test_trainer_ramps_and_resumes_mid_ramp_exactly(text_tokens, tmp_path):
    ramp = [2, 2, 16]  # global 8: batches 2 2 2 4 4 6 8 8
    root, logs = str(tmp_path / "ck"), str(tmp_path / "full")
    full_raw = tiny_run(text_tokens, train_iters=8, save=root, save_interval=4,
                        rampup_batch_size=ramp, eval_iters=0)
    full_raw["logging"].update(run_dir=logs, log_interval=1)
    full = train(full_raw, 1)
    want = ramp_batches(ramp, 8, 8)
    assert want == [2, 2, 2, 4, 4, 6, 8, 8]
    steps = _batches(logs)
    assert [b for _, b, _ in steps] == want
    assert [c for _, _, c in steps] == [sum(want[:i + 1]) for i in range(8)]
    with open(os.path.join(root, "latest"), "w") as fh:  # resume at step 4: mid-ramp
        fh.write("iter_0000004\n")
    resumed_raw = tiny_run(text_tokens, train_iters=8, load=root, rampup_batch_size=ramp,
                           eval_iters=0)
    resumed_raw["logging"].update(run_dir=str(tmp_path / "resumed"), log_interval=1)
    resumed = train(resumed_raw, 1)
    assert resumed["first_step"] == 5
    assert resumed["losses"] == full["losses"][4:]  # steps 5..8, bit for bit
    assert _batches(str(tmp_path / "resumed")) == steps[4:]


def test_ramp_over_two_data_parallel_ranks(text_tokens, tmp_path):
    """EP=2 on 2 ranks (data-parallel 2): every batch of the ramp is whole microbatches on
    both ranks; the steps take Megatron's batches and the losses stay finite."""
    ramp = [4, 4, 16]  # micro batch 2 x DP 2 = 4 per microbatch round; batches 4 4 4 8 ...
    raw = tiny_run(text_tokens, parallel={"ep": 2}, train_iters=5, rampup_batch_size=ramp,
                   eval_iters=0)
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=1)
    losses = train(raw, 2)["losses"]
    assert [b for _, b, _ in _batches(str(tmp_path / "run"))] == ramp_batches(ramp, 8, 5)
    assert ramp_batches(ramp, 8, 5) == [4, 4, 4, 4, 8]
    assert all(0 < loss < 10 for loss in losses)
