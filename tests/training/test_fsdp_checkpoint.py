"""Megatron-FSDP checkpoints (Megatron-LM's --ckpt-format fsdp_dtensor,
training/fsdp_checkpoint.py): a run saved under Megatron-FSDP resumes to the uninterrupted
run's losses, exactly at the saved layout and within float summation order at another
data-parallel size; a layout or format it cannot read is one CheckpointError naming the fix.
(No dropout, so the 1-rank resume, whose generators are reseeded, can be compared; the RNG
files are the format-independent part, tests/training/test_training.py checks them.)"""

import json
import os
import subprocess
import sys

import pytest

from harness import tiny_run, train

from megatron_mvmoe.testing.spawn import free_port, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(600)

FSDP = dict(megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            use_distributed_optimizer=True)

LAYOUTS = {  # 2 ranks each
    "dp2_fp32": ({}, "fp32"),
    # expert parallelism: Megatron's chained (dense + expert) optimizer; bf16: fp32 main
    # weights beside the bf16 model weights
    "ep2_bf16": ({"ep": 2}, "bf16"),
}


def _fsdp_run(text_tokens, name, **training):
    parallel, precision = LAYOUTS[name]
    raw = tiny_run(text_tokens, preset="tiny_smoe", parallel=parallel, train_iters=6,
                   eval_iters=2 if name == "dp2_fp32" else 0, ckpt_format="fsdp_dtensor",
                   precision=precision, **training)
    raw["optimizer"].update(FSDP)
    return raw


@pytest.fixture(scope="module")
def saved_runs(text_tokens, tmp_path_factory):
    """Per layout, built once: the uninterrupted 2-rank FSDP run, saving at steps 3 and 6,
    with `latest` rewound to step 3; (checkpoint root, its losses)."""
    runs, evaluations = {}, {}

    def saved(name):
        if name not in runs:
            root = str(tmp_path_factory.mktemp(name) / "ck")
            full = train(_fsdp_run(text_tokens, name, save=root, save_interval=3), 2)
            with open(os.path.join(root, "latest"), "w") as fh:
                fh.write("iter_0000003\n")
            runs[name] = root, full["losses"]
            evaluations[name] = full["eval"]
        return runs[name]
    saved.evaluations = evaluations
    return saved


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resume_at_the_saved_layout_is_exact(text_tokens, saved_runs, name):
    root, full = saved_runs(name)
    resumed = train(_fsdp_run(text_tokens, name, load=root), 2)
    assert resumed["first_step"] == 4
    assert resumed["losses"] == full[3:], (resumed["losses"], full[3:])


def test_resume_at_another_data_parallel_size_continues(text_tokens, saved_runs):
    """DCP reshards the DTensors: the 2-rank checkpoint continues on one rank (the sums over
    the batch run in another order, so within 1e-5, not bit for bit)."""
    root, full = saved_runs("dp2_fp32")
    resumed = train(_fsdp_run(text_tokens, "dp2_fp32", load=root), 1)
    assert resumed["first_step"] == 4
    diffs = [abs(a - b) for a, b in zip(resumed["losses"], full[3:])]
    assert len(diffs) == 3 and max(diffs) < 1e-5, (resumed["losses"], full[3:])


def test_a_run_without_megatron_fsdp_is_refused_naming_the_flags(text_tokens, saved_runs):
    root, _ = saved_runs("dp2_fp32")
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=6, eval_iters=0, load=root)
    with pytest.raises(Exception) as err:
        train(raw, 1)
    assert "holds fsdp_dtensor tensors; this run reads torch_dist" in str(err.value)
    assert "Fix: resume with --use-megatron-fsdp --ckpt-format fsdp_dtensor" in str(err.value)


def test_another_tensor_or_expert_layout_is_refused_naming_the_sizes():
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.training.fsdp_checkpoint import check_fsdp_layout

    saved = {"tp": 2, "pp": 1, "ep": 2, "etp": 1, "vpp": None}
    check_fsdp_layout(saved, dict(saved), "ck")  # the same layout, any DP size: loads
    with pytest.raises(CheckpointError) as err:
        check_fsdp_layout(saved, dict(saved, tp=1), "ck")
    assert "(tp 2 -> 1)" in str(err.value) and "Fix: resume with the saved" in str(err.value)


LINE = ["--model-preset", "tiny_smoe"]


@pytest.mark.parametrize("flags, field, fix", [
    (["--use-megatron-fsdp", "--save", "ck"], "training.ckpt_format",
     "Fix: add --ckpt-format fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor"], "training.ckpt_format",
     "Fix: add --use-megatron-fsdp, or use --ckpt-format torch_dist"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--save", "ck", "--async-save"],
     "training.async_save", "Fix: drop --async-save"),
    (["--use-megatron-fsdp", "--warm-start-from", "ck"], "training.warm_start_from",
     "Fix: warm-start without --use-megatron-fsdp"),
])
def test_what_megatron_lm_refuses_is_refused_in_one_line(flags, field, fix):
    """Megatron-LM asserts that Megatron-FSDP checkpoints are fsdp_dtensor and that
    fsdp_dtensor is Megatron-FSDP's; background fsdp_dtensor saves and warm starts into a
    Megatron-FSDP model are not wired here."""
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError) as err:
        config_from_args(LINE + flags).validate()
    assert str(err.value).startswith(f"{field}: ") and fix in str(err.value)
    assert "\n" not in str(err.value)


def test_the_tools_read_the_weights_at_another_layout(text_tokens, saved_runs):
    """tools/evaluate.py (the tools' reader, checkpointing/fsdp_weights.py) on the step-6
    fsdp_dtensor checkpoint of the DP 2 run, on 4 ranks at TP 2 x expert TP 2 x EP 2, equals
    the trainer's own evaluation at step 6 (within 1e-5): SwiGLU's fc1, saved whole at TP 1
    as [w; v], is cut as [w_r; v_r]; experts saved under their global index are read as
    local_experts.<i> of their EP rank."""
    root, _ = saved_runs("dp2_fp32")
    trainer_eval = saved_runs.evaluations["dp2_fp32"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(free_port()), "tools/evaluate.py", "--load",
         os.path.join(root, "iter_0000006"), "--tensor-model-parallel-size", "2",
         "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2", "--json"],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["step"] == 6 and set(result["components"]) == set(trainer_eval)
    for name, loss in trainer_eval.items():
        assert abs(result["components"][name]["loss"] - loss) < 1e-5, (name, result, loss)


def _checks_at_step_2(rank, world_size, raw):
    """At step 2's start, the save's non-finite check as is, then with one saved weight shard
    of rank 0 (an fp32 main weight) NaN, restored after; returns both verdicts."""
    import copy

    import torch

    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training import checkpoint as ckpt
    from megatron_mvmoe.training.fsdp_checkpoint import fsdp_weight_shards
    from megatron_mvmoe.training.pretrain import pretrain

    pgs = initialize_layout(config_from_dict(copy.deepcopy(raw)).parallel.layout(), timeout_s=60)
    verdicts = []

    def verdict(trainer):
        try:
            ckpt._refuse_nonfinite(trainer, 2, "ck")
            return None
        except Exception as err:  # noqa: BLE001 - the verdict is the message
            return str(err)

    def on_step(step, trainer):
        if step != 2:
            return
        verdicts.append(verdict(trainer))
        shard = kept = None
        if rank == 0:
            shard = next(t for n, t in fsdp_weight_shards(trainer.model)
                         if "linear_proj.weight" in n and t.numel())
            kept = shard.clone()
            with torch.no_grad():
                shard.fill_(float("nan"))
        verdicts.append(verdict(trainer))
        if shard is not None:
            with torch.no_grad():
                shard.copy_(kept)
    pretrain(config_from_dict(raw), pgs, on_step=on_step)
    return verdicts


def test_the_non_finite_check_reads_the_weights_a_save_writes(text_tokens):
    """Between steps a Megatron-FSDP module's parameters are views of its unsharded weight
    buffer, whose memory is reused until the next forward gathers it: the check read them and
    refused a save of the EP 2 bf16 run for a NaN there once, with every saved weight finite.
    It reads what the save writes, the DTensor shards: finite passes, a NaN shard (an fp32
    main weight, which the module's bf16 views do not show) is refused naming it."""
    raw = _fsdp_run(text_tokens, "ep2_bf16")
    raw["training"]["train_iters"] = 3
    for clean, poisoned in run_distributed(_checks_at_step_2, 2, timeout_s=300, args=(raw,)):
        assert clean is None, clean
        assert poisoned is not None and "linear_proj.weight on rank 0 is NaN/inf" in poisoned
