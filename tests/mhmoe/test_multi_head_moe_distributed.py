"""MH-MoE at EP=2 on gloo: outputs and grads equal EP=1 within 1e-5, and the bytes through
the expert-parallel all-to-all equal the analytic count (H * k sub-token rows of D/H per
token, dispatch and combine)."""
import pytest
import torch
import torch.distributed as dist

from megatron_mvmoe.functional.parity import MoELayerShape, all_to_all_bytes_per_token
from megatron_mvmoe.layers.builders import build
from megatron_mvmoe.layers.mh_reference import mh_test_config
from megatron_mvmoe.layers.multi_head_moe import mh_moe_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed

S, B, D, H, K, E, FFN = 4, 2, 8, 2, 2, 4, 6


def _global_weights():
    gen = torch.Generator().manual_seed(11)
    return {"router": torch.randn(E, D // H, generator=gen),
            "head": torch.randn(D, D, generator=gen) * 0.4,
            "merge": torch.randn(D, D, generator=gen) * 0.4,
            "fc1": torch.randn(E, 2 * FFN, D // H, generator=gen) * 0.4,
            "fc2": torch.randn(E, D // H, FFN, generator=gen) * 0.4}


def _load(layer, w):
    with torch.no_grad():
        layer.moe.router.weight.copy_(w["router"])
        layer.head.weight.copy_(w["head"])
        layer.merge.weight.copy_(w["merge"])
        for i, expert in enumerate(layer.moe.experts.local_experts):
            g = layer.moe.local_expert_indices[i]
            expert.linear_fc1.weight.copy_(w["fc1"][g])
            expert.linear_fc2.weight.copy_(w["fc2"][g])


def _count_all_to_all(calls):
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        calls.append((tuple(input.shape), input.numel() * input.element_size()))
        return original(output, input, *args, **kwargs)
    return original, counting


def _run(rank, world_size, ep):
    pg = initialize_layout(ParallelLayout(ep=ep))
    config = mh_test_config(heads=H, topk=K, experts=E, hidden=D, ffn=FFN,
                            expert_model_parallel_size=ep)
    layer = build(mh_moe_spec(config), config=config, pg_collection=pg)
    _load(layer, _global_weights())
    x = torch.randn(S, B, D, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    calls = []
    original, counting = _count_all_to_all(calls)
    dist.all_to_all_single = counting
    try:
        out, _ = layer(x)
    finally:
        dist.all_to_all_single = original
    out.pow(2).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "head_grad": layer.head.weight.grad,
            "merge_grad": layer.merge.weight.grad, "router_grad": layer.moe.router.weight.grad,
            "expert_grads": {layer.moe.local_expert_indices[i]: e.linear_fc1.weight.grad
                             for i, e in enumerate(layer.moe.experts.local_experts)},
            "calls": calls}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run, 1, args=(1,))[0], run_distributed(_run, 2, args=(2,))


def test_ep2_matches_ep1(runs):
    ref, results = runs
    for r in results:  # every rank saw the same replicated tokens
        for key in ("out", "x_grad", "head_grad", "merge_grad", "router_grad"):
            torch.testing.assert_close(r[key], ref[key], atol=1e-5, rtol=0)
    # Each expert receives both ranks' (identical) tokens: twice the EP=1 gradient.
    merged = {g: grad for r in results for g, grad in r["expert_grads"].items()}
    assert sorted(merged) == list(range(E))
    for g, grad in ref["expert_grads"].items():
        torch.testing.assert_close(merged[g], 2 * grad, atol=1e-5, rtol=1e-5)


def test_all_to_all_bytes_equal_analytic_count(runs):
    ref, results = runs
    assert ref["calls"] == []  # EP=1: no all-to-all
    rows_per_rank = S * B * H * K  # sub-token rows sent per rank
    shape = MoELayerShape(hidden_size=D, num_experts=E, expert_ffn=FFN, topk=K, num_heads=H)
    analytic = S * B * all_to_all_bytes_per_token(shape)
    assert analytic == rows_per_rank * (D // H) * 4  # = T * k * D * fp32 bytes
    combine_total = 0
    for r in results:
        hidden = [c for c in r["calls"] if len(c[0]) == 2 and c[0][1] == D // H]
        probs = [c for c in r["calls"] if len(c[0]) == 1]
        assert len(hidden) == 2, r["calls"]  # dispatch then combine
        assert hidden[0][1] == analytic  # dispatch: every sub-token row, once per slot
        assert probs[0][1] == rows_per_rank * 4  # gates travel with the rows
        combine_total += hidden[1][1]
    assert combine_total == len(results) * analytic  # combine returns every row
