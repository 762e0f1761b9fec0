"""The planner's collective transient (planning/memory.py) rests on one measured fact of
gloo: all_gather_into_tensor and reduce_scatter_tensor stage their whole flat buffer in a
temporary, all_reduce works in place (platform/collective_memory.py). This probes that fact
on real gloo ranks, and checks the planner's term against a count written out here."""

import pytest

from megatron_mvmoe.planning.plan import PlanTarget
from megatron_mvmoe.planning.memory import (collective_transient, optimizer_step_transient,
                                                 rank_memory, stage_parameters)
from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.parallel import ParallelLayout
from megatron_mvmoe.testing.spawn import run_distributed

SHARD_NUMEL = 16 * 2**20  # 64 MiB of fp32 per rank: far above glibc's mmap threshold


def _staging_worker(rank, world_size):
    from megatron_mvmoe.platform.collective_memory import OPS, staging_bytes

    return {op: staging_bytes(op, SHARD_NUMEL) for op in OPS}


@pytest.mark.parametrize("world", [1, 2])
def test_gloo_stages_the_whole_buffer_of_gather_and_scatter(world):
    for rank in run_distributed(_staging_worker, world, timeout_s=240):
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            got = rank[op]
            # within 10 % + 4 MiB: what the allocator and gloo's pools add around the copy
            slack = 0.1 * got["buffer_bytes"] + 4 * 2**20
            assert abs(got["staged_bytes"] - got["buffer_bytes"]) <= slack, (op, got)
        reduce = rank["all_reduce"]
        assert reduce["staged_bytes"] < 0.1 * reduce["buffer_bytes"], reduce


def test_planner_collective_terms_against_a_written_out_count():
    """The larger of the rank's dense and expert buffers, fp32, on CPU with the distributed
    optimizer; nothing on GPU (NCCL in place) or without it (all-reduce in place); the
    step's peak is the largest of the phases, not their sum."""
    m = model_from_preset("mvmoe_10b_a1b", num_layers=2, seq_length=128, vocab_size=4096)
    target = PlanTarget(ParallelLayout(pp=2, ep=2), world_size=4, micro_batch_size=1,
                        global_batch_size=4)
    E, F, L = m.num_experts, m.moe_ffn_hidden_size, m.latent_size
    experts_per_rank = (E // 2) * 3 * F * L  # one layer per stage, fc1 (2F x L) + fc2 (L x F)
    for stage in (0, 1):
        p = stage_parameters(m, target, stage)
        assert p["experts"] == experts_per_rank
        assert collective_transient(m, target, stage, "cpu_fp32") == 4 * max(p["dense"],
                                                                              experts_per_rank)
        assert collective_transient(m, target, stage, "gpu_bf16") == 0
        assert collective_transient(m, target, stage, "cpu_fp32", False) == 0
        assert optimizer_step_transient(m, target, stage, "gpu_bf16") == 0
        row = rank_memory(m, target, stage)
        static = row["params"] + row["grads"] + row["optimizer"]
        step = max(row["activations"], row["collective_transient"],
                   row["optimizer_step_transient"])
        assert row["total"] == pytest.approx(static + step)
        assert row["total_with_save"] == pytest.approx(
            static + max(step, row["checkpoint_save_transient"]))
