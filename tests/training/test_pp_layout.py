"""Megatron-LM's --pipeline-model-parallel-layout (parallel.pp_layout): the stages hold the
layers the layout string places there, not an even split."""

import pytest
from megatron_mvmoe.config.flags import config_from_args

from tests.config.test_megatron_flags import BASE
from harness import tiny_run, train


def test_an_uneven_layout_trains_as_at_pp1(text_tokens, tmp_path):
    """3 decoder layers as "Et|ttL" (1 + 2, which no even split gives) at PP 2, from the
    initial weights PP 1 saved: PP 1's losses. The checkpoint's global layer numbers follow
    the layout's offsets (stage 1's first layer is layer 2), so the right weights load."""
    def run(parallel, world, **training):
        raw = tiny_run(text_tokens, parallel=parallel, eval_iters=0, **training)
        raw["model"]["num_layers"] = 3
        raw["optimizer"]["warmup_iters"] = 1
        return train(raw, world)["losses"]

    init = str(tmp_path / "init")
    run({}, 1, train_iters=0, save=init)
    from_init = dict(train_iters=2, load=init, load_optimizer=False)
    one = run({}, 1, **from_init)
    two = run({"pp": 2, "pp_layout": "Et|ttL"}, 2, **from_init)
    assert len(two) == 2 and max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)


@pytest.mark.parametrize("layout,extra,message", [
    ("Et|tXL", [], r"--pipeline-model-parallel-layout.*Invalid layer character: X"),
    ("Et|t|tL", [], r"--pipeline-model-parallel-layout.*3 stages.*pipeline-model-parallel-size 2"),
    ("Et|ttL", ["--virtual-pipeline-model-parallel-size", "2"],
     r"--pipeline-model-parallel-layout.*1 virtual stages per rank but parallel.vpp is 2"),
    ("Et|t|t|tL", ["--num-virtual-stages-per-pipeline-rank", "2"],
     r"--num-virtual-stages-per-pipeline-rank: not supported together with "
     r"--pipeline-model-parallel-layout"),
], ids=["bad_char", "stages_not_pp_multiple", "vpp_conflict", "virtual_stages_too"])
def test_a_bad_layout_is_refused_in_one_line_naming_the_flag(layout, extra, message):
    argv = BASE + ["--pipeline-model-parallel-size", "2",
                   "--pipeline-model-parallel-layout", layout] + extra
    with pytest.raises(ValueError, match=message) as err:
        config_from_args(argv)
    assert "\n" not in str(err.value)


def test_a_layout_that_misplaces_the_model_layers_names_the_flag():
    """Megatron-Core's own check (it asserts) as one line: 2 layers placed, 3 in the model."""
    from megatron_mvmoe.models.build import validate_run
    run = config_from_args(BASE + ["--num-layers", "3", "--pipeline-model-parallel-size", "2",
                                   "--pipeline-model-parallel-layout", "Et|tL"])
    with pytest.raises(ValueError, match=r"^parallel.pp_layout \(--pipeline-model-parallel-"
                                         r"layout\): .*\(model: 3 layers, 0 MTP\)") as err:
        validate_run(run)
    assert "\n" not in str(err.value)


def test_the_planner_counts_each_stage_by_the_layout():
    """planning/memory.py's per-stage counts follow the layout (stage 0 of "Et|ttL" holds 1
    of the 3 layers, stage 1 two), not num_layers // pp."""
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.parallel import ParallelLayout
    from megatron_mvmoe.planning.memory import activation_bytes, stage_parameters
    from megatron_mvmoe.planning.plan import PlanTarget

    model = model_from_preset("tiny_smoe", num_layers=3)
    target = PlanTarget(ParallelLayout(pp=2, pp_layout="Et|ttL"), world_size=2)
    first, last = (stage_parameters(model, target, s) for s in (0, 1))
    even = PlanTarget(ParallelLayout(pp=3), world_size=3)  # one layer a stage
    one = stage_parameters(model, even, 1)  # a middle stage: one layer, no embedding
    assert last["experts"] == 2 * one["experts"] == 2 * first["experts"] > 0
    acts = [activation_bytes(model, target, s, "cpu_fp32")["per_microbatch"] for s in (0, 1)]
    assert acts[1] > acts[0]
