"""Every flag of Megatron-LM's arguments.py is known and classified; a launch line's
refusals come in one pass; list/expression and samples-based forms mean what they mean in
Megatron-LM (checked against Megatron-LM's own code, not a copy of it)."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_mvmoe.config import flags, megatron_flags, megatron_lm_rules
from megatron_mvmoe.config import megatron_lm_table as mlt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
REFUSAL = re.compile(r"^--[\w-]+( \S+)?: not supported: .+\. Use instead: .+$")
# The flags of issue 26 that were "unknown" before.
ISSUE_FLAGS = ["--train-samples", "--lr-decay-samples", "--lr-warmup-samples",
               "--lr-warmup-fraction", "--lr-warmup-init", "--norm-epsilon",
               "--distributed-timeout-minutes", "--rotary-scaling-factor",
               "--calculate-per-token-loss", "--manual-gc", "--no-mmap-bin-files",
               "--log-params-norm", "--log-num-zeros-in-grad", "--logging-level",
               "--auto-detect-ckpt-format", "--dist-ckpt-strictness", "--deterministic-mode",
               "--attention-softmax-in-fp32", "--no-bias-gelu-fusion",
               "--use-persistent-ckpt-worker", "--no-check-for-nan-in-loss-and-grad",
               "--q-lora-rank"]


def _arguments_py():
    import gen_megatron_lm_flags as gen
    try:
        return gen, gen.arguments_file()
    except FileNotFoundError as err:
        pytest.skip(f"Megatron-LM's arguments.py is not installed ({err})")


def test_table_has_every_add_argument_call_of_arguments_py():
    gen, path = _arguments_py()
    explicit = gen.ast_flags(path)
    assert len(explicit) > 300
    for name, takes_value in explicit.items():
        assert name in mlt.table(), name
        assert mlt.table()[name].takes_value == takes_value, name


@pytest.mark.slow
def test_table_equals_megatron_lm_parser():
    _arguments_py()
    proc = subprocess.run([sys.executable, "tools/gen_megatron_lm_flags.py", "--check",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["same"], \
        proc.stdout[-2000:] + proc.stderr[-2000:]


def _non_default(row):
    if not row.takes_value:
        return True
    return "[1]" if row.nargs in ("+", "*") else "not-the-default-123"


def test_every_table_flag_is_classified():
    parser = flags.build_parser()
    ours = {f.name for f in flags.FLAGS} | set(megatron_lm_rules.CONVERTED)
    counts = {"implemented": 0, "accepted": 0, "refused": 0}
    for name, row in mlt.table().items():
        assert any(name in a.option_strings for a in parser._actions), name
        if name in ours:
            counts["implemented"] += 1
        elif name in megatron_flags.ACCEPTED:
            counts["accepted"] += 1
        elif name in megatron_flags.UNSUPPORTED:
            why, instead = megatron_flags.UNSUPPORTED[name]
            assert why and instead, name
            counts["refused"] += 1
        else:
            verdict = mlt.classify(name, _non_default(row))
            if verdict.refusal:
                assert REFUSAL.match(verdict.refusal), verdict.refusal
                counts["refused"] += 1
                if row.takes_value and row.default is not None:  # the default is harmless
                    assert mlt.classify(name, row.default).note, name
            else:
                assert verdict.note.startswith(name) and len(verdict.note) > len(name) + 10
                counts["accepted"] += 1
    assert sum(counts.values()) == len(mlt.table()) and min(counts.values()) > 10, counts


def _refusals(argv):
    with pytest.raises(ValueError) as err:
        flags.config_from_args(argv)
    return str(err.value)


def test_refusals_of_a_line_come_in_one_pass():
    text = _refusals(["--model-preset", "tiny_smoe", "--cache-mla-latents", "--squared-relu",
                      "--frobnicate", "--use-torch-fsdp2", "--train-samples",
                      "100", "--global-batch-size", "8", "--use-rope-scaling"])
    lines = text.splitlines()
    assert lines[0] == "6 flags refused:", text
    for name in ("--cache-mla-latents", "--squared-relu", "--frobnicate", "--use-torch-fsdp2",
                 "--train-samples 100", "--use-rope-scaling"):
        assert any(line.strip().startswith(name) for line in lines[1:]), (name, text)
    assert "--train-samples 96 or 104" in text


def test_issue_flags_are_known_not_unknown():
    for name in ISSUE_FLAGS:
        assert name in mlt.table(), name
        value = [] if not mlt.table()[name].takes_value else ["2"]
        try:
            flags.config_from_args(["--model-preset", "tiny_smoe", name, *value])
        except ValueError as err:
            assert "unknown flag" not in str(err) and "Fix" in str(err) or \
                REFUSAL.match(str(err)), err


def test_moe_layer_freq_list_form_is_megatron_lms():
    config = flags.config_from_args(["--model-preset", "tiny_smoe", "--num-layers", "4",
                                     "--moe-layer-freq", "[0]*1+[1]*3"])
    assert config.model.extra["moe_layer_freq"] == [0, 1, 1, 1]  # naive: the list's meaning
    text = _refusals(["--model-preset", "tiny_smoe", "--moe-layer-freq", "[0]*"])
    assert text.count("\n") == 0 and "--moe-layer-freq" in text


def _lrs(scheduler, steps, increment):
    out = []
    for _ in range(steps):
        scheduler.step(increment=increment)
        out.append(scheduler.get_lr(scheduler.optimizer.param_groups[0]))
    return out


def test_samples_schedule_equals_megatron_lms_sample_counting():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = 4
    config = flags.config_from_args(
        ["--model-preset", "tiny_smoe", "--global-batch-size", str(gbs), "--train-samples",
         "48", "--lr-decay-samples", "40", "--lr-warmup-fraction", "0.1", "--lr", "1e-3",
         "--min-lr", "1e-4", "--lr-warmup-init", "1e-5", "--distributed-timeout-minutes",
         "3"])
    o = config.optimizer
    assert (config.training.train_iters, o.decay_iters, o.warmup_iters) == (12, 10, 1)
    assert config.parallel.distributed_timeout_seconds == 180.0

    def scheduler(warmup, decay):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        return OptimizerParamScheduler(
            opt, init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup,
            lr_decay_steps=decay, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
            wd_incr_steps=decay, wd_incr_style="constant")
    # Megatron-LM: steps in samples, warmup = fraction * decay samples, +gbs per step.
    megatron = _lrs(scheduler(0.1 * 40, 40), 12, gbs)
    ours = _lrs(scheduler(o.warmup_iters, o.decay_iters), 12, 1)
    assert megatron == pytest.approx(ours, rel=1e-12)


def test_flex_dispatcher_without_deepep_fails_before_the_build():
    import importlib.util
    if importlib.util.find_spec("deep_ep") or importlib.util.find_spec("hybrid_ep"):
        pytest.skip("DeepEP/HybridEP installed: flex is buildable")
    text = _refusals(["--model-preset", "tiny_smoe", "--moe-token-dispatcher-type", "flex"])
    assert text.count("\n") == 0 and "DeepEP or HybridEP" in text and \
        "--moe-token-dispatcher-type alltoall" in text


@pytest.mark.parametrize("spelling", ["--use-checkpoint-opt_param-scheduler",
                                      "--override-opt_param-scheduler"])
def test_megatron_lms_underscore_spellings_mean_the_same_flag(spelling):
    """Megatron-LM's argparse registers both spellings (25 of its 63 MoE functional tests use
    the underscore form); they were refused as "not supported", twice per line."""
    from megatron_mvmoe.config import flags
    from megatron_mvmoe.config.megatron_lm_table import other_spellings, table

    assert other_spellings(spelling) == [spelling.replace("_", "-")]
    field = table()[spelling].dest
    run = flags.config_from_args(["--model-preset", "tiny_smoe", spelling])
    assert getattr(run.training, field) is True
    assert all(other_spellings(name) for name in table() if "_" in name)  # each has its twin


def test_logging_level_sets_the_root_level_as_megatron_lm_does(monkeypatch):
    """--logging-level was accepted and ignored (a note claimed it changed nothing); Megatron-LM
    sets the root logger's level from it, else from MEGATRON_LOGGING_LEVEL."""
    import logging

    from megatron_mvmoe.log_noise import apply_logging_level

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    run = flags.config_from_args(["--model-preset", "tiny_smoe", "--logging-level", "40"])
    assert apply_logging_level(run.logging.logging_level) == 40 and root.level == 40
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
    assert apply_logging_level(None) == 30 and root.level == 30
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL")
    assert apply_logging_level(None) is None and root.level == 30


def test_a_default_valued_flag_is_noted_without_claiming_it_runs():
    """The note said "--muon-momentum 0.9: Megatron-LM's default, which is what runs here"
    while Adam runs: a flag given at its default changes nothing, and that is all it says."""
    note = mlt.classify("--muon-momentum", "0.9").note
    assert "runs here" not in note and note.endswith("the line means the same without it")


def test_virtual_stages_per_pipeline_rank_is_the_virtual_pipeline_size():
    """Megatron-LM's validate_args: virtual_pipeline_model_parallel_size =
    num_virtual_stages_per_pipeline_rank (1 = none); it was dropped without a word."""
    line = ["--model-preset", "tiny_smoe", "--num-layers", "4",
            "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank"]
    assert flags.config_from_args(line + ["2"]).parallel.vpp == 2
    assert flags.config_from_args(line + ["1"]).parallel.vpp is None
    text = _refusals(line + ["2", "--virtual-pipeline-model-parallel-size", "2"])
    assert "--num-virtual-stages-per-pipeline-rank: not supported together with " \
           "--virtual-pipeline-model-parallel-size" in text


def test_fractional_warmup_gives_megatron_lms_learning_rates(monkeypatch):
    """--lr-warmup-fraction 0.15 of 10 steps is 1.5 steps: refused before; Megatron-LM counts
    samples (warmup = 0.15 x 10 x 16 samples), so its warmup ends mid-step. Its own
    get_optimizer_param_scheduler, from its own parser, against ours, step by step."""
    import gen_megatron_lm_parity as gen
    import torch
    from megatron.training import global_vars

    from megatron_mvmoe.training.build import _scheduler

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.setenv(name, os.environ.get(name, "0"))  # restored after the test
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    line = gen.BARE_LINE + gen.EXPLICIT + ["--disable-bias-linear", "--lr-warmup-fraction",
                                           "0.15", "--lr-warmup-init", "1e-5"]
    args = gen.megatron_lm_args(line)  # WORLD_SIZE 8: DP 8, global batch 16
    theirs = gen.megatron_lm_scheduler(args)
    run = flags.config_from_args(line)
    assert run.training.global_batch_size == args.global_batch_size == 16
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=run.optimizer.lr)
    mine = _scheduler(run, adam)
    assert theirs.lr_warmup_steps == 24.0 and mine.lr_warmup_steps * 16 == pytest.approx(24)
    megatron, ours = _lrs(theirs, 10, 16), _lrs(mine, 10, 1)
    assert megatron == pytest.approx(ours, rel=1e-12, abs=0) and len(set(megatron)) == 10


def test_mtp_with_pipeline_parallelism_resolves():
    """Found by the functional-test corpus (gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed): MTP
    under PP was refused on CPU; it trains since platform/cpu_embedding_copy.py
    (test_mtp.py::test_mtp_with_pipeline_parallelism_trains_as_at_pp1)."""
    run = flags.config_from_args(["--model-preset", "tiny_smoe", "--num-layers", "4",
                                  "--mtp-num-layers", "1", "--pipeline-model-parallel-size",
                                  "2"])
    assert run.model.extra["mtp_num_layers"] == 1 and run.parallel.pp == 2


def test_checkpoint_integrity_and_async_strategy_flags_say_what_runs(capsys):
    """--verify-integrity is what every load here does (SHA-256 manifest); --async-strategy
    mcore is the writer used; nvrx (nvidia-resiliency-ext) is refused naming the fix."""
    run = flags.config_from_args(["--model-preset", "tiny_smoe", "--verify-integrity",
                                  "--async-strategy", "mcore", "--async-ckpt-use-cpu-shm"])
    assert run.model.preset == "tiny_smoe"
    with pytest.raises(ValueError, match=r"--async-strategy nvrx: not supported: .*"
                                         r"nvidia-resiliency-ext.*Use instead: "
                                         r"--async-strategy mcore"):
        flags.config_from_args(["--model-preset", "tiny_smoe", "--async-strategy", "nvrx"])
    notes = flags.compat_notes(flags.build_parser().parse_args(
        ["--verify-integrity", "--async-ckpt-use-cpu-shm"]))
    assert any("SHA-256 manifest" in n for n in notes) and \
        any("'mcore' writer" in n for n in notes), notes


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--bf16",
                                                       "--accumulate-allreduce-grads-in-fp32"]])
def test_gradients_reduce_in_the_dtype_megatron_lms_validate_args_picks(monkeypatch, precision):
    """Megatron-LM's validate_args turns --accumulate-allreduce-grads-in-fp32 on for --bf16
    (its --main-grads-dtype default is fp32; "bfloat16 requires gradient accumulation and
    all-reduce to be done in fp32"): a bare line with --bf16 reduces in fp32 here too, not in
    bf16 as the parser default alone would say."""
    import gen_megatron_lm_parity as gen
    from megatron.training import global_vars

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    line = gen.BARE_LINE + gen.EXPLICIT + precision
    theirs = gen.megatron_lm_args(line).accumulate_allreduce_grads_in_fp32
    assert flags.config_from_args(line).optimizer.grad_reduce_in_fp32 == theirs == bool(precision)


def test_no_persist_layer_norm_asks_for_what_runs():
    """Megatron-LM's --no-persist-layer-norm turns apex's persistent LayerNorm off, which no
    run here uses (models/provider.py): accepted with a note saying so. It was refused
    ("accepted by Megatron only with TE ... drop the flag")."""
    from megatron_mvmoe.models.provider import transformer_config

    run = flags.config_from_args(["--model-preset", "tiny_smoe", "--no-persist-layer-norm"])
    assert transformer_config(run.model).persist_layer_norm is False
    notes = flags.compat_notes(flags.build_parser().parse_args(["--no-persist-layer-norm"]))
    assert any("persistent LayerNorm kernel is off in every run" in n for n in notes), notes
