"""MultiHeadMoELayer on one gloo process: naive reference, hand-computed routing, switches,
H = 1 reduces to Megatron's SMoE, shared expert, BitNet, decoder-layer integration."""
import pytest
import torch

from megatron_mvmoe.layers.builders import build as build_spec
from megatron_mvmoe.layers.mh_reference import mh_test_config, naive_mh_moe
from megatron_mvmoe.layers.multi_head_moe import MultiHeadMoELayer, mh_moe_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.platform import apply_cpu_patches
from megatron_mvmoe.testing.spawn import run_distributed


def _with_groups(rank, world_size, body, kwargs):
    apply_cpu_patches()
    body(initialize_layout(ParallelLayout()), **kwargs)


def run_in_child(body, **kwargs):
    """Run `body(pg, **kwargs)` in a forked one-rank gloo process: initialising gloo in the
    pytest process itself makes later forked distributed tests hang."""
    run_distributed(_with_groups, 1, timeout_s=120, args=(body, kwargs))


def build(pg, seed=0, **cfg):
    torch.manual_seed(seed)
    config = mh_test_config(**cfg)
    return build_spec(mh_moe_spec(config), config=config, pg_collection=pg), config


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _matches_naive_reference(pg, cfg):
    layer, _ = build(pg, **cfg)
    x = randn(3, 2, 8).requires_grad_(True)
    out, bias = layer(x)
    assert bias is None and out.shape == x.shape
    x_ref = x.detach().clone().requires_grad_(True)
    ref = naive_mh_moe(layer, x_ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


def _sub_tokens_of_one_token_route_to_different_experts(pg):
    layer, _ = build(pg, heads=2, head=False, merge=False, experts=2, topk=1, hidden=4)
    with torch.no_grad():
        layer.moe.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    seen = {}
    layer.moe.router.register_forward_hook(lambda m, i, o: seen.update(map=o[1]))
    x = torch.tensor([[[5.0, 0.0, 0.0, 5.0]]])  # sub-token 0 -> expert 0, sub-token 1 -> 1
    out, _ = layer(x)
    assert seen["map"].tolist() == [[True, False], [False, True]]
    # Concatenation order: each half is its own expert's output on its own half, gated.
    experts = layer.moe.experts.local_experts
    gate = torch.softmax(torch.tensor([5.0, 0.0]), 0)[0]
    for half, expert in ((0, experts[0]), (1, experts[1])):
        sub = x[0, 0, 2 * half:2 * half + 2]
        g, u = torch.chunk(sub @ expert.linear_fc1.weight.t(), 2)
        want = gate * (torch.nn.functional.silu(g) * u) @ expert.linear_fc2.weight.t()
        torch.testing.assert_close(out[0, 0, 2 * half:2 * half + 2], want)


def _switches_change_exactly_the_named_modules(pg, head, merge):
    layer, _ = build(pg, head=head, merge=merge)
    names = {n.split(".")[0] for n, _ in layer.named_parameters()}
    assert names == {"moe"} | ({"head"} if head else set()) | ({"merge"} if merge else set())
    full, _ = build(pg, head=True, merge=True)
    ours = {n: p for n, p in layer.named_parameters() if n.startswith("moe.")}
    theirs = {n: p for n, p in full.named_parameters() if n.startswith("moe.")}
    assert {n: p.shape for n, p in ours.items()} == {n: p.shape for n, p in theirs.items()}
    x = randn(2, 3, 8)
    torch.testing.assert_close(layer(x)[0], naive_mh_moe(layer, x), atol=1e-5, rtol=1e-5)


def _no_split_routes_whole_tokens(pg):
    layer, _ = build(pg, heads=1, split=False)
    assert layer.moe.router.weight.shape == (4, 8) and layer.head is not None
    with pytest.raises(ValueError, match="split_tokens"):
        build(pg, heads=2, split=False)


def _stock_layer(pg, config):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron_mvmoe.layers.builders import parts
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=False)
    return MoELayer(config=config, submodules=parts(spec).submodules, pg_collection=pg)


def _one_head_reduces_to_stock_smoe(pg, identity_projections):
    layer, config = build(pg, heads=1, head=identity_projections, merge=identity_projections)
    torch.manual_seed(7)
    stock = _stock_layer(pg, mh_test_config(heads=1, moe_variant="smoe"))
    layer.moe.load_state_dict(stock.state_dict())
    if identity_projections:
        with torch.no_grad():
            layer.head.weight.copy_(torch.eye(8))
            layer.merge.weight.copy_(torch.eye(8))
    x = randn(4, 2, 8).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    want, _ = stock(x2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.moe.router.weight.grad, stock.router.weight.grad,
                               atol=1e-6, rtol=0)


def _shared_expert_runs_on_full_tokens(pg):
    layer, _ = build(pg, shared=5)
    assert layer.shared_experts.linear_fc1.weight.shape == (10, 8)  # SwiGLU: 2 x 5 on full D
    assert layer.moe.config.moe_shared_expert_intermediate_size is None
    assert layer.moe.router.weight.shape == (4, 4)  # D / H


def _padding_mask_is_split_per_sub_token(pg):
    layer, _ = build(pg, heads=2)
    mask = torch.tensor([[False, True, False], [True, False, False]])  # [B=2, S=3]
    assert layer.split_padding_mask(mask).tolist() == [
        [False, True, False], [False, True, False], [True, False, False], [True, False, False]]
    out, _ = layer(randn(3, 2, 8), padding_mask=mask)
    assert out.shape == (3, 2, 8)


def _bitnet_quantizes_projections_and_experts(pg):
    from megatron_mvmoe.layers.bitnet import BitColumnParallelLinear
    plain, _ = build(pg, seed=3)
    quant, _ = build(pg, seed=3, bitnet=True)
    assert isinstance(quant.moe.experts.local_experts[0].linear_fc1, BitColumnParallelLinear)
    with torch.no_grad():  # O(1) weights: Megatron's 0.02-std init makes outputs ~1e-10
        for i, param in enumerate(plain.parameters()):
            param.copy_(randn(*param.shape, seed=10 + i) * 0.5)
    quant.load_state_dict(plain.state_dict())
    x = randn(2, 2, 8)
    assert not torch.allclose(quant(x)[0], plain(x)[0])
    quant(x)[0].sum().backward()
    assert quant.head.weight.grad is not None and quant.head.weight.grad.abs().sum() > 0


def _plugs_into_a_transformer_layer(pg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer
    config = mh_test_config(heads=2, normalization="RMSNorm")
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    spec.submodules.mlp = mh_moe_spec(config)  # a fresh spec object from the builder
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # attention forks this RNG (CPU-patched)
    torch.manual_seed(0)
    layer = TransformerLayer(config, spec.submodules, layer_number=1, pg_collection=pg)
    assert isinstance(layer.mlp, MultiHeadMoELayer) and layer.mlp.moe.layer_number == 1
    x = randn(5, 2, 8).requires_grad_(True)
    out, _ = layer(x, attention_mask=None)
    out.sum().backward()
    assert out.shape == x.shape and layer.mlp.head.weight.grad is not None


@pytest.mark.parametrize("cfg", [dict(heads=2, topk=2), dict(heads=4, topk=1, hidden=8),
                                 dict(heads=2, topk=2, shared=5)])
def test_matches_naive_reference(cfg):
    run_in_child(_matches_naive_reference, cfg=cfg)


def test_sub_tokens_of_one_token_route_to_different_experts():
    run_in_child(_sub_tokens_of_one_token_route_to_different_experts)


@pytest.mark.parametrize("head, merge", [(True, True), (True, False), (False, True),
                                         (False, False)])
def test_switches_change_exactly_the_named_modules(head, merge):
    run_in_child(_switches_change_exactly_the_named_modules, head=head, merge=merge)


def test_no_split_routes_whole_tokens():
    run_in_child(_no_split_routes_whole_tokens)


@pytest.mark.parametrize("identity_projections", [False, True])
def test_one_head_reduces_to_stock_smoe(identity_projections):
    run_in_child(_one_head_reduces_to_stock_smoe, identity_projections=identity_projections)


def test_shared_expert_runs_on_full_tokens():
    run_in_child(_shared_expert_runs_on_full_tokens)


def test_padding_mask_is_split_per_sub_token():
    run_in_child(_padding_mask_is_split_per_sub_token)


def test_bitnet_quantizes_projections_and_experts():
    run_in_child(_bitnet_quantizes_projections_and_experts)


def test_plugs_into_a_transformer_layer():
    run_in_child(_plugs_into_a_transformer_layer)
