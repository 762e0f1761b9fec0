"""The planner's CP term (planning/context_parallel.py) against naive references:
the bytes our CP core attention really hands to gloo (the real collectives, counted as
they run) at CP = 2 and 4, and the 10B-A1B plan at CP = 2 against its CP = 1 plan with
the differences written out by hand."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_mvmoe.planning.plan import PlanTarget, plan
from megatron_mvmoe.planning.context_parallel import kv_bytes_per_layer
from megatron_mvmoe.config.model_section import ModelSection, model_from_preset
from megatron_mvmoe.parallel import ParallelLayout
from megatron_mvmoe.testing.spawn import run_distributed

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 8, 2, 4, 2, 3


def _counted_attention_rank(rank, world_size):
    """One forward + backward of CPDotProductAttention with every all_gather /
    all_reduce it issues counted: bytes received (all-gather) and ring bytes sent
    (all-reduce, 2 (c-1)/c of the tensor)."""
    from megatron_mvmoe.testing.cp_attention import cp_attention_on_this_rank

    attention, _ = cp_attention_on_this_rank(world_size, HEADS, GROUPS, HEAD_DIM)
    counted = {"all_gather": 0.0, "all_reduce": 0.0}
    real_gather, real_reduce = dist.all_gather, dist.all_reduce
    c = world_size

    def all_gather(parts, tensor, group=None, **kwargs):
        counted["all_gather"] += (len(parts) - 1) * tensor.numel() * tensor.element_size()
        return real_gather(parts, tensor, group=group, **kwargs)

    def all_reduce(tensor, group=None, **kwargs):
        counted["all_reduce"] += 2 * (c - 1) / c * tensor.numel() * tensor.element_size()
        return real_reduce(tensor, group=group, **kwargs)

    local = SEQ // c
    q = torch.randn(local, BATCH, HEADS, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(local, BATCH, GROUPS, HEAD_DIM, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    dist.all_gather, dist.all_reduce = all_gather, all_reduce
    try:
        attention(q, k, v, None).float().sum().backward()
    finally:
        dist.all_gather, dist.all_reduce = real_gather, real_reduce
    return counted


@pytest.mark.parametrize("cp", [2, 4])
def test_kv_bytes_equal_the_counted_collectives(cp):
    m = ModelSection(moe_variant="dense", num_layers=1, hidden_size=HEADS * HEAD_DIM,
                     num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=SEQ)
    predicted = kv_bytes_per_layer(m, BATCH, ParallelLayout(cp=cp), dtype_bytes=2)
    for counted in run_distributed(_counted_attention_rank, cp):
        assert counted["all_gather"] == pytest.approx(predicted["forward_all_gather"])
        assert counted["all_reduce"] == pytest.approx(predicted["backward_all_reduce"])
    # naive: K and V, (c-1) remote chunks of S/c positions, g d bf16 elements each
    assert predicted["forward_all_gather"] == 2 * (cp - 1) * (SEQ // cp) * BATCH * GROUPS \
        * HEAD_DIM * 2


def test_10b_plan_at_cp2_against_cp1_by_hand():
    m = model_from_preset("mvmoe_10b_a1b")
    one = plan(m, PlanTarget(ParallelLayout(tp=2, ep=8), world_size=16,
                             global_batch_size=64))
    two = plan(m, PlanTarget(ParallelLayout(tp=2, ep=8, cp=2), world_size=16,
                             global_batch_size=64))
    S, D, h = m.seq_length, m.hidden_size, m.num_attention_heads
    g, d = m.num_query_groups or h, D // h
    assert two["layout"]["cp"] == 2 and two["layout"]["dp"] == one["layout"]["dp"] // 2
    cp = two["context_parallel"]
    assert cp["tokens_per_rank_per_microbatch"] == S // 4  # S / (cp tp), microbatch 1
    assert cp["kv_all_gather_bytes_per_layer"] == 2 * (S / 2) * (g / 2) * d * 2  # K+V, bf16
    assert cp["kv_grad_all_reduce_bytes_per_layer"] == 2 * cp["kv_all_gather_bytes_per_layer"]
    microbatches = 64 // two["layout"]["dp"]
    assert cp["kv_bytes_per_rank_per_step"] == pytest.approx(
        3 * cp["kv_all_gather_bytes_per_layer"] * m.num_layers * microbatches)
    assert cp["attention_forward_flops_per_rank_per_layer"] == 4 * (S / 2) * S * D / 2
    assert one["context_parallel"]["kv_bytes_per_rank_per_step"] == 0
    assert two["flops_per_token"] == one["flops_per_token"]  # per token: unchanged
    # memory: weights/grads whole on each CP rank; dense Adam state over DP x CP (the same
    # ranks as DP alone at CP = 1 on this world); activations halve, plus the gathered K/V
    mem1, mem2 = one["memory_bytes_per_gpu"], two["memory_bytes_per_gpu"]
    assert mem2["weights"] == mem1["weights"] and mem2["optimizer"] == mem1["optimizer"]
    extra_kv = m.num_layers * 2 * (S / 2) * (g / 2) * d * 2
    assert mem2["activations_estimate"] == pytest.approx(
        mem1["activations_estimate"] / 2 + extra_kv)
    # the all-to-all carries each rank's S/(cp tp) tokens: half per microbatch, twice the
    # microbatches (DP halves), the same per step
    assert two["a2a_bytes"]["per_layer_dispatch"] == one["a2a_bytes"]["per_layer_dispatch"] / 2
    assert two["a2a_bytes"]["per_rank_per_step"] == one["a2a_bytes"]["per_rank_per_step"]


def test_plan_refuses_a_sequence_cp_does_not_split():
    m = dataclasses.replace(model_from_preset("tiny_multi_view"), seq_length=30)
    from megatron_mvmoe.planning.plan import check_layout
    with pytest.raises(ValueError, match=r"layout.cp: seq_length 30"):
        check_layout(m, PlanTarget(ParallelLayout(cp=2), global_batch_size=8))


@pytest.mark.parametrize("precision", ["cpu_fp32", "gpu_bf16"])
def test_rank_memory_at_cp2_against_cp1_by_hand(precision):
    """Per rank (plan_memory): every saved activation is per local token, so CP = 2 halves
    a microbatch's activations; the CP attention adds the remote K/V and (without flash
    attention) keeps half the S x S softmax; dense Adam state splits over DP x CP."""
    from megatron_mvmoe.planning.memory import Numerics, rank_memory

    m = model_from_preset("mvmoe_10b_a1b")
    one = rank_memory(m, PlanTarget(ParallelLayout(tp=2, ep=8), world_size=16), 0, precision,
                      stacked=False)
    two = rank_memory(m, PlanTarget(ParallelLayout(tp=2, ep=8, cp=2), world_size=16), 0,
                      precision, stacked=False)
    S, D, h = m.seq_length, m.hidden_size, m.num_attention_heads
    g, d, e = m.num_query_groups or h, D // h, Numerics.of(precision).activation
    remote_kv = 2 * (S / 2) * (g / 2) * d  # K and V of the other rank, TP shard, microbatch 1
    # everything halves with the local tokens, the CPU softmax [b, h/tp, S/2, S] included
    # (half of the S x S one at CP = 1); plus the remote K/V of every layer
    expected = one["activations_per_microbatch"] / 2 + m.num_layers * e * remote_kv
    assert two["activations_per_microbatch"] == pytest.approx(expected)
    assert two["params"] == one["params"] and two["grads"] == one["grads"]
    # DP 8 at CP = 1, DP 4 x CP 2 at CP = 2: the same 8 ranks share the dense Adam state
    assert two["optimizer"] == pytest.approx(one["optimizer"])


def test_plan_tool_cp_flag(tmp_path):
    import json
    import os
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "plan.py")
    out = subprocess.run([sys.executable, tool, "--config", "mvmoe_10b_a1b", "--tp", "2",
                          "--ep", "8", "--cp", "2", "--world-size", "16", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["layout"]["cp"] == 2 and report["layout"]["dp"] == 4
    assert report["context_parallel"]["kv_bytes_per_rank_per_step"] > 0
