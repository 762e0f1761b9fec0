"""Every CPU patch is still needed by unmodified Megatron-Core (its probe breaks without
it) and takes effect (its probe passes after apply_cpu_patches). Runs the probes in a fresh
interpreter, since the patches are process-wide once applied."""

import json
import subprocess
import sys

import pytest
import torch

PROBE = r"""
import json, warnings
warnings.filterwarnings("ignore")
from megatron_mvmoe.platform.cpu_patches import ALL_PATCHES, apply_cpu_patches
before = {p.name: p.still_needed() for p in ALL_PATCHES}
applied = apply_cpu_patches()
after = {p.name: p.still_needed() for p in ALL_PATCHES}
again = apply_cpu_patches()
print(json.dumps({"before": before, "after": after, "applied": applied, "again": again}))
"""


@pytest.fixture(scope="module")
def probe():
    if torch.cuda.is_available():
        pytest.skip("CPU patches are a no-op with CUDA")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_patch_is_still_needed(probe):
    stale = [name for name, needed in probe["before"].items() if not needed]
    assert not stale, f"Megatron no longer breaks at these points; remove the patches: {stale}"


def test_every_patch_applies(probe):
    failing = [name for name, needed in probe["after"].items() if needed]
    assert not failing, f"patches that did not take effect: {failing}"


def test_patches_are_idempotent(probe):
    assert probe["applied"] == list(probe["before"])
    assert probe["again"] == []


def test_version_guard_rejects_other_megatron(monkeypatch):
    import megatron.core.package_info as info

    from megatron_mvmoe.platform import cpu_patches

    cpu_patches.check_megatron_version()  # the pinned release passes
    monkeypatch.setattr(info, "__shortversion__", "0.19.1")
    with pytest.raises(RuntimeError, match="megatron-core==0.19.2"):
        cpu_patches.check_megatron_version()


UPSTREAM_FIXES = r"""
import json, warnings
warnings.filterwarnings("ignore")
from megatron.core import utils
from megatron.core.transformer.moe import moe_utils
print(json.dumps({"te_general_gemm defined": hasattr(moe_utils, "te_general_gemm"),
                  "is_te_min_version without TE": utils.is_te_min_version("1.0")}))
"""


def test_patches_dropped_for_0_19_2_stay_unneeded():
    """0.16.1 needed patches for these; 0.19.2 fixed them upstream (moe_utils.py:42-54,
    utils.py:317-323). Unpatched Megatron, fresh interpreter: they must still work."""
    out = subprocess.run([sys.executable, "-c", UPSTREAM_FIXES], capture_output=True,
                         text=True, timeout=120, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == {"te_general_gemm defined": True, "is_te_min_version without TE": False}


def _reinit_cycles(rank, world_size, cycles, hold_references=False):
    import os

    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    counts, held = [], []
    for _ in range(cycles):
        pg = initialize_layout(ParallelLayout(ep=2), training=False)
        if hold_references:  # what a model, optimizer or test object left alive does
            held.append(pg)
        destroy_layout()
        counts.append(threads())
    return counts


def test_reinitialising_parallel_state_50_times_keeps_thread_count_flat():
    from megatron_mvmoe.testing.spawn import run_distributed

    for counts in run_distributed(_reinit_cycles, 2, timeout_s=240, args=(50,)):
        # unpatched, every cycle leaves ~30 gloo threads behind (1500 after 50 cycles)
        assert counts[-1] - counts[0] <= 2, counts


def test_reinitialising_while_old_groups_are_referenced_keeps_thread_count_flat():
    """The groups of every earlier cycle stay referenced (as a model built on them would
    keep them): destroying them frees no gloo thread, so only reuse keeps the count flat."""
    from megatron_mvmoe.testing.spawn import run_distributed

    for counts in run_distributed(_reinit_cycles, 2, timeout_s=240, args=(30, True)):
        # creating new groups each cycle: ~30 threads per cycle (900 after 30)
        assert counts[-1] - counts[0] <= 2, counts


def _groups_reused_rank(rank, world_size):
    from megatron.core import parallel_state

    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout

    initialize_layout(ParallelLayout(ep=2), training=False)
    first = parallel_state.get_expert_model_parallel_group()
    destroy_layout()
    initialize_layout(ParallelLayout(tp=2), training=False)
    tp = parallel_state.get_tensor_model_parallel_group()
    destroy_layout()
    initialize_layout(ParallelLayout(ep=2), training=False)
    again = parallel_state.get_expert_model_parallel_group()
    value = torch.ones(1)
    torch.distributed.all_reduce(value, group=again)
    destroy_layout()
    return again is first, tp.size(), first.size(), float(value)


def test_pooled_groups_are_the_same_ranks_and_still_communicate():
    from megatron_mvmoe.testing.spawn import run_distributed

    for reused, tp_size, ep_size, summed in run_distributed(_groups_reused_rank, 2,
                                                            timeout_s=120):
        assert reused and tp_size == 2 and ep_size == 2 and summed == 2.0


def test_indices_to_multihot_is_patched_where_it_is_defined():
    """Megatron's own callers (and its tests) import the converter from
    megatron.core.fusions.fused_indices_converter: the CPU version must be found there."""
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    from megatron.core.fusions import fused_indices_converter
    from megatron.core.transformer.moe import token_dispatcher

    assert token_dispatcher.fused_indices_to_multihot is (
        fused_indices_converter.fused_indices_to_multihot)
    multihot_TN, probs_TN = fused_indices_converter.fused_indices_to_multihot(
        torch.tensor([[1, -1]], dtype=torch.int32), torch.tensor([[0.5, 0.25]]), 3)
    assert multihot_TN.tolist() == [[False, True, False]]
    assert probs_TN.tolist() == [[0.0, 0.5, 0.0]]


def test_indices_to_multihot_on_cpu_matches_a_loop():
    from megatron_mvmoe.platform import apply_cpu_patches
    from megatron_mvmoe.platform.cpu_function_fixes import indices_to_multihot_torch

    apply_cpu_patches()
    from megatron.core.transformer.moe import token_dispatcher

    indices_TK = torch.tensor([[0, 3], [2, -1], [5, 1], [-1, -1]], dtype=torch.int32)
    probs_TK = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]],
                            requires_grad=True)
    multihot_TN, probs_TN = token_dispatcher.fused_indices_to_multihot(indices_TK, probs_TK, 4)
    want_map = torch.zeros(4, 4, dtype=torch.bool)
    want_probs = torch.zeros(4, 4)
    for t in range(4):
        for k in range(2):
            e = int(indices_TK[t, k])
            if 0 <= e < 4:
                want_map[t, e] = True
                want_probs[t, e] = probs_TK[t, k]
    assert torch.equal(multihot_TN, want_map)
    torch.testing.assert_close(probs_TN, want_probs)
    probs_TN.sum().backward()
    local_TK = (indices_TK >= 0) & (indices_TK < 4)
    torch.testing.assert_close(probs_TK.grad, local_TK.float())
    # the dispatcher's binding is the CPU stand-in, and that stand-in alone gives the loop's
    assert getattr(token_dispatcher.fused_indices_to_multihot, "_mvmoe_wrapped", False)
    direct_TN, _ = indices_to_multihot_torch(indices_TK, probs_TK.detach(), 4)
    assert torch.equal(direct_TN, want_map)


def test_cpu_stream_is_a_noop_context():
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.ones(2, device=torch.cuda.current_device())
    assert x.device.type == "cpu"


def test_layout_errors_name_the_sizes():
    from megatron_mvmoe.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"tp\*pp = 3\*1 = 3 does not divide world size 4"):
        ParallelLayout(tp=3).validate(4)
    with pytest.raises(ValueError, match="num_moe_experts 6 is not divisible by ep 4"):
        ParallelLayout(ep=4).validate(4, num_experts=6)
    with pytest.raises(ValueError, match="ep=1 with etp=1 < tp=2"):
        ParallelLayout(tp=2, etp=1).validate(2, num_experts=4)
    ParallelLayout(tp=2, etp=1).validate(2)  # no experts: nothing to reduce
    ParallelLayout(tp=2, etp=1).validate(2, num_experts=4, training=False)
    with pytest.raises(ValueError, match="num_layers 3"):
        ParallelLayout(pp=2).validate(4, num_layers=3)


def apply_cpu_patches_in_this_process():
    from megatron_mvmoe.platform.cpu_patches import apply_cpu_patches

    apply_cpu_patches()


def test_layernorm_recompute_runs_without_transformer_engine():
    """CheckpointWithoutOutput with its default fp8=False (Megatron's norm recompute) runs a
    forward and backward on CPU, equal to the plain computation."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    apply_cpu_patches_in_this_process()
    x_TD = torch.randn(4, 3, requires_grad=True)
    ref_TD = x_TD.detach().clone().requires_grad_(True)
    ckpt = CheckpointWithoutOutput()
    assert ckpt.fp8 is False and CheckpointWithoutOutput(fp8=None).fp8 is False
    assert CheckpointWithoutOutput(fp8="e4m3").fp8 is True
    y_TD = ckpt.checkpoint(torch.tanh, x_TD)
    out = (y_TD * 2.0).sum()
    ckpt.discard_output_and_register_recompute(out)
    out.backward()
    (torch.tanh(ref_TD) * 2.0).sum().backward()
    assert torch.equal(x_TD.grad, ref_TD.grad)


def test_dropout_in_a_tracker_fork_logs_no_cpu_rng_warning(caplog):
    """With dropout on CPU, Megatron's fork() warned "CPU RNG state changed within GPU RNG
    context" on every fork (80 lines in 5 steps): the fork's stream is the CPU generator
    here. Only that message is dropped; the logger still prints others."""
    import logging

    from megatron.core.tensor_parallel import random as mrandom

    from megatron_mvmoe.platform.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    logger = logging.getLogger(mrandom.__name__)
    with caplog.at_level(logging.WARNING, logger=mrandom.__name__):
        with tracker.fork("model-parallel-rng"):
            torch.nn.functional.dropout(torch.ones(8), p=0.5)
        logger.warning("another message")
    assert [r.getMessage() for r in caplog.records if r.name == mrandom.__name__] == [
        "another message"]
