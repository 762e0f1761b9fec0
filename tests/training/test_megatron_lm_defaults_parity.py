"""A bare Megatron-LM launch line gets Megatron-LM's defaults, field by field (issue 36).

The record tests/assets/megatron_lm_parity/bare_moe_line.json is what Megatron-LM's own parser
built from a line that gives only what Megatron-LM requires (shape, micro batch, steps, lr)
and the data (tools/gen_megatron_lm_parity.py, BARE_LINE): its TransformerConfig, optimizer
config, DDP config, scheduler and launch fields at WORLD_SIZE 8. The same line through this
trainer's flags must give the same values everywhere, except the differences listed below,
each with the reason; and every run-config field behind a Megatron-LM flag the line leaves
out must hold Megatron-LM's parser default (megatron_lm_flags.json) or a named exception
(config/megatron_lm_defaults.py), so a new flag whose default differs fails here.

On the code before issue 36 the run-config check found 8 silent differences (adam_beta2 0.95,
weight_decay 0.1, min_lr 1e-4, cosine decay, distributed optimizer on, timeout 120 s, eval
50/4, log interval 1) and the precision (auto = bf16 on a GPU)."""

import dataclasses
import json
import os

import pytest
from test_megatron_lm_parity import DIFFERENCES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = os.path.join(ROOT, "tests", "assets", "megatron_lm_parity")

# The GPT-3 line's platform differences that a bare line shares (same reasons), and four
# more: the bare line keeps its biases (so Megatron-LM fuses bias-GeLU) and leaves
# gradient-accumulation fusion and TE's weight sharding at Megatron-LM's defaults, which the
# GPT-3 line switches off.
TRANSFORMER_DIFFERENCES = {
    "bias_activation_fusion": (True, False, "off with GeLU: Megatron-Core's fused bias-GeLU "
                                            "does not serve experts that scale rows by their "
                                            "probs (SequentialMLP); models/provider.py"),
    **{name: DIFFERENCES[name] for name in (
        "bias_dropout_fusion",
        "masked_softmax_fusion", "persist_layer_norm", "cp_comm_type", "inference_sampling_seed",
        "use_cpu_initialization", "deallocate_pipeline_outputs")},
    "gradient_accumulation_fusion": (True, False, "needs APEX's or TE's fused weight-gradient "
                                                  "kernel; chosen per machine"),
    "tensor_parallel_num_weight_shards": (1, None, "TE userbuffer sharding; not used"),
    "expert_tensor_parallel_num_weight_shards": (1, None, "TE userbuffer sharding; not used"),
}
_INERT = "inert here: "
OPTIMIZER_DIFFERENCES = {
    "barrier_with_L1_time": (True, False, _INERT + "read only by Megatron-LM's timers, which "
                                          "this trainer does not pass"),
    "fp8_recipe": ("delayed", None, _INERT + "read only with FP8 (refused)"),
    "optimizer_offload_fraction": (1.0, 0.0, _INERT + "read only with --optimizer-cpu-offload "
                                                      "(refused)"),
}
DDP_DIFFERENCES = {
    "check_for_nan_in_grad": (True, False, "the loop's own check (training/nonfinite.py) does "
                                           "what --check-for-nan-in-loss-and-grad does"),
}


@pytest.fixture(scope="module", params=["bare_moe_line", "bare_moe_line_bf16"])
def record(request):
    """The bare line, and the bare line with --bf16 (what validate_args derives from bf16:
    its gradients reduce in fp32, which this trainer's defaults missed)."""
    with open(os.path.join(RECORDS, f"{request.param}.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def run(record):
    """The record's line through this trainer's flags at the record's world size."""
    from megatron_mvmoe.config.flags import config_from_args

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(record["world_size"])
    try:
        return config_from_args(record["line"])
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def _value(run, path):
    value = run
    for part in path.split("."):
        value = getattr(value, part)
    return value


def test_every_run_config_field_behind_a_megatron_lm_flag_has_its_default(record, run):
    """Each value flag of ours that Megatron-LM has, left out of the line: the field holds
    Megatron-LM's parser default, in our field's terms where the spelling differs."""
    from megatron_mvmoe.config import megatron_lm_defaults as defaults
    from megatron_mvmoe.config.flag_table import FLAGS
    from megatron_mvmoe.config.megatron_lm_table import table

    given = set(record["line"])
    checked, wrong = 0, {}
    for flag in FLAGS:
        path = f"{flag.section}.{flag.field}"
        if flag.const is not None or flag.field.startswith("extra.") or \
                flag.name not in table() or flag.name in given or path in defaults.DERIVED:
            continue
        default = table()[flag.name].default
        if path in defaults.KEPT:
            continue  # test_kept_fields_are_noted_once
        expected = defaults.TRANSLATED.get(path, lambda v: v)(default)
        checked += 1
        if _value(run, path) != expected:
            wrong[path] = (expected, _value(run, path))
    assert checked >= 40 and wrong == {}
    # the switches and converted flags Megatron-LM gives a default through
    bf16 = "--bf16" in record["line"]
    assert (run.training.precision, run.parallel.distributed_timeout_seconds,
            run.optimizer.grad_reduce_in_fp32) == ("bf16" if bf16 else "fp32", 600.0, bf16)


def test_derived_fields_follow_megatron_lms_validate_args(record, run):
    args = record["model_args"]
    assert run.training.global_batch_size == args["global_batch_size"] == 16  # 2 x DP 8
    assert run.model.num_query_groups is None  # no --group-query-attention: one per head


def test_optimizer_config_equal_field_by_field(record, run):
    from gen_megatron_lm_parity import _fields

    from megatron_mvmoe.models.build import model_config
    from megatron_mvmoe.training.build import optimizer_config

    mine = _fields(optimizer_config(run, model_config(run)))
    _assert_equal_but(record["optimizer_config"], mine, OPTIMIZER_DIFFERENCES, minimum=50)


def test_ddp_config_equal_field_by_field(record, run):
    from gen_megatron_lm_parity import _fields

    from megatron_mvmoe.training.build import ddp_config

    _assert_equal_but(record["ddp_config"], _fields(ddp_config(run)), DDP_DIFFERENCES,
                      minimum=30)


def test_transformer_config_equal_field_by_field(record, run):
    from gen_megatron_lm_parity import _jsonable

    from megatron_mvmoe.models.build import use_bf16
    from megatron_mvmoe.models.provider import transformer_config

    p = run.parallel
    config = transformer_config(run.model, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                                use_bf16=use_bf16(run), on_cpu=False)
    mine = {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    _assert_equal_but(record["transformer_config"], mine, TRANSFORMER_DIFFERENCES, minimum=250)


def test_schedule_equal_in_samples(record, run):
    """Megatron-LM's scheduler counts samples, ours steps: linear decay to 0 over the run."""
    import torch

    from megatron_mvmoe.training.build import _scheduler

    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=run.optimizer.lr)
    mine, theirs = _scheduler(run, adam), record["scheduler"]
    for name in ("max_lr", "min_lr", "init_lr", "lr_decay_style", "start_wd", "end_wd"):
        assert getattr(mine, name) == theirs[name], name
    assert mine.lr_decay_steps * run.training.global_batch_size == theirs["lr_decay_steps"]
    assert (theirs["lr_decay_style"], theirs["min_lr"]) == ("linear", 0.0)


def test_launch_fields_equal(record, run):
    theirs = record["training_args"]
    assert (run.training.eval_iters, run.logging.log_interval, run.training.seed) == (
        theirs["eval_iters"], theirs["log_interval"], theirs["seed"]) == (100, 100, 1234)
    assert theirs["eval_interval"] is None and run.training.eval_interval == 0  # at the end
    assert theirs["save_interval"] is None and run.training.save_interval == 0
    assert run.parallel.distributed_timeout_seconds == 60 * theirs["distributed_timeout_minutes"]


def test_kept_fields_are_noted_once(record, capfd):
    """A field Megatron-LM has no default for keeps ours, said once at start-up with the value."""
    from megatron_mvmoe.config.flags import config_from_args

    line = list(record["line"])
    del line[line.index("--lr"):line.index("--lr") + 2]
    run = config_from_args(line)
    err = capfd.readouterr().err
    assert err.count("--lr not given") == 1 and f"this run uses {run.optimizer.lr}" in err
    config_from_args(record["line"])
    assert "not given" not in capfd.readouterr().err


def test_group_query_attention_alone_is_one_group(record):
    from megatron_mvmoe.config.flags import config_from_args

    assert config_from_args(record["line"] + ["--group-query-attention"]
                            ).model.num_query_groups == 1


def test_our_yaml_and_presets_keep_their_values():
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.config.run_config import OptimizerSection

    run = config_from_args(["--model-preset", "tiny_smoe"])
    assert run.optimizer == OptimizerSection()  # not Megatron-LM's: not a Megatron-LM line


def test_bf16_without_the_distributed_optimizer_saves_and_resumes(text_tokens, tmp_path):
    """Megatron-LM's default optimizer (not distributed) in bf16: the model's norms were fp32
    among bf16 weights, and every save failed with "Param id 24 does not match any model
    sharded param" (models/build.py _params_to_model_dtype)."""
    from harness import tiny_run, train

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=3, save=str(tmp_path / "ck"),
                   precision="bf16")
    raw["optimizer"]["use_distributed_optimizer"] = False
    assert train(raw, 1)["last_checkpoint"].endswith("iter_0000003")
    raw["training"].update(train_iters=4, load=str(tmp_path / "ck"))
    assert train(raw, 1)["first_step"] == 4


def _assert_equal_but(theirs, mine, differences, minimum):
    assert len(theirs) >= minimum  # every field, not a pick
    mine = json.loads(json.dumps(mine))  # tuples as the record's lists
    found = {name: (value, mine.get(name, "<absent>")) for name, value in theirs.items()
             if value != mine.get(name, "<absent>")}
    assert found == {name: (mega, our) for name, (mega, our, _) in differences.items()}
