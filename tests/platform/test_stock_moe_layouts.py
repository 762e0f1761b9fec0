"""Stock Megatron-Core MoELayer (alltoall dispatcher, sigmoid + expert bias, SequentialMLP)
runs forward and backward on CPU/gloo at EP=1, 2, 4 and TP=2 (ETP=1), and EP=2 / TP=2
agree with EP=1 within 1e-5."""

import pytest
import torch

from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.testing.stock_moe import (build_stock_moe_layer, gather_expert_grads,
                                              global_moe_weights, load_global_moe_weights,
                                              sigmoid_moe_config)

SEQ, BATCH = 6, 2


def _global_input(hidden: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, hidden, generator=torch.Generator().manual_seed(7))


def _run_layer(rank, world_size, tp, ep):
    layout = ParallelLayout(tp=tp, ep=ep, etp=1)
    # training=False: TP=2 with EP=1, ETP=1 is fine for a layer's forward/backward (compared
    # here before any data-parallel reduction) but refused for training, see ParallelLayout.
    pgs = initialize_layout(layout, training=False)
    config = sigmoid_moe_config(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=1, sequence_parallel=tp > 1)
    layer = build_stock_moe_layer(config, pgs)
    load_global_moe_weights(layer, global_moe_weights(config))
    x = _global_input(config.hidden_size)
    if tp > 1:  # sequence parallel: each TP rank holds a slice of the sequence
        x = x.chunk(tp, dim=0)[pgs.tp.rank()].contiguous()
    x.requires_grad_(True)
    out, _ = layer(x)
    (out.pow(2).sum()).backward()
    return {"out": out.detach(), "x_grad": x.grad.detach(),
            "router_grad": layer.router.weight.grad.detach(),
            "expert_grads": gather_expert_grads(layer, config.num_moe_experts),
            "tp_rank": pgs.tp.rank()}


def _reference():
    return run_distributed(_run_layer, 1, args=(1, 1))[0]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("world_size,tp,ep", [(2, 1, 2), (4, 1, 4), (2, 2, 1)])
def test_layout_matches_ep1(reference, world_size, tp, ep):
    results = run_distributed(_run_layer, world_size, args=(tp, ep))
    if tp > 1:
        out = torch.cat([r["out"] for r in sorted(results, key=lambda r: r["tp_rank"])], 0)
        x_grad = torch.cat([r["x_grad"] for r in sorted(results, key=lambda r: r["tp_rank"])], 0)
    else:  # pure EP: every rank saw the same tokens (data replicated for the comparison)
        out, x_grad = results[0]["out"], results[0]["x_grad"]
    torch.testing.assert_close(out, reference["out"], atol=1e-5, rtol=0)
    torch.testing.assert_close(x_grad, reference["x_grad"], atol=1e-5, rtol=0)
    # Expert grads before the data-parallel reduction: with TP=2/ETP=1 each rank holds
    # every expert and sees its half of the sequence (sum over ranks = full grad); with
    # pure EP every rank pushes the same replicated tokens (world_size times the grad).
    scale = 1.0 if tp > 1 else world_size
    expert_grads = {}
    for r in results:
        for eid, grad in r["expert_grads"].items():
            expert_grads[eid] = expert_grads.get(eid, 0) + grad
    for eid, grad in reference["expert_grads"].items():
        torch.testing.assert_close(expert_grads[eid], grad * scale, atol=1e-5, rtol=1e-5)
