"""BitNet b1.58: ternary weights, int8 activations, STE, Megatron linears, a CPU training run."""
import torch
import torch.nn.functional as F

from megatron_mvmoe.functional.quantize import (absmax_activation, bitlinear_input,
                                                quantize_weight_ste, ternary_weight)
from megatron_mvmoe.layers.bitnet import (BitColumnParallelLinear, BitLinear,
                                          BitRowParallelLinear, bitnet_spec)
from megatron_mvmoe.testing.spawn import run_distributed


def test_weights_are_three_values_times_one_scale():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    ternary, gamma = ternary_weight(w)
    assert set(ternary.unique().tolist()) == {-1.0, 0.0, 1.0}
    assert torch.isclose(gamma, w.abs().mean())
    dequant = quantize_weight_ste(w)
    assert set(dequant.unique().tolist()) == {-gamma.item(), 0.0, gamma.item()}
    # Rounding rule: |w| < gamma / 2 -> 0, otherwise sign(w).
    assert torch.equal(ternary, torch.where(w.abs() < gamma / 2, 0.0, w.sign()))


def test_activations_fit_int8_per_token():
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(1)) * 3
    x_int, scale = absmax_activation(x, bits=8)
    assert torch.equal(x_int, x_int.round())
    assert x_int.min() >= -128 and x_int.max() <= 127
    assert torch.equal(x_int.abs().amax(-1), torch.full((5, 7), 127.0))  # each token uses range
    assert (x_int / scale - x).abs().max() <= (0.5 / scale).max() + 1e-6


def test_zero_input_and_weight_do_not_nan():
    assert torch.equal(quantize_weight_ste(torch.zeros(3, 3)), torch.zeros(3, 3))
    x_int, scale = absmax_activation(torch.zeros(2, 4))
    assert torch.isfinite(x_int / scale).all()


def test_ste_gradients_pass_to_latent_weights():
    torch.manual_seed(2)
    layer = BitLinear(8, 4, input_norm=False)
    x = torch.randn(6, 8, requires_grad=True)
    grad_out = torch.randn(6, 4)
    layer(x).backward(grad_out)
    x_int, scale = absmax_activation(x.detach())
    w_q = quantize_weight_ste(layer.weight.detach())
    assert torch.allclose(layer.weight.grad, grad_out.t() @ (x_int / scale), atol=1e-5)
    assert torch.allclose(x.grad, grad_out @ w_q, atol=1e-5)
    assert layer.weight.dtype == torch.float32 and layer.weight.is_leaf  # latent stays fp32


def test_bitlinear_normalises_its_input_before_int8_quantization():
    """BitNet b1.58: y = W_q Quant8(RMSNorm(x)); naive reference written out here."""
    gen = torch.Generator().manual_seed(3)
    layer = BitLinear(16, 8)
    x = torch.randn(4, 5, 16, generator=gen) * torch.rand(4, 5, 1, generator=gen) * 10
    x_norm = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    scale = 127.0 / x_norm.abs().amax(-1, keepdim=True)
    x_q = (x_norm * scale).round().clamp(-128, 127) / scale
    w = layer.weight.detach()
    w_q = (w / w.abs().mean()).round().clamp(-1, 1) * w.abs().mean()
    assert torch.allclose(layer(x), x_q @ w_q.t(), atol=1e-5)
    x_int, _ = absmax_activation(bitlinear_input(x))
    assert x_int.min() >= -128 and x_int.max() <= 127  # still int8 after the norm
    # The norm makes a linear blind to its input's scale; without it the output scales.
    assert torch.allclose(layer(7.0 * x), layer(x), atol=1e-5)
    raw = BitLinear(16, 8, input_norm=False)
    raw.load_state_dict(layer.state_dict())
    assert torch.allclose(raw(7.0 * x), 7.0 * raw(x), atol=1e-4)
    assert not torch.allclose(raw(7.0 * x), layer(7.0 * x), atol=1e-2)


def test_tiny_bitnet_model_learns_a_linear_map():
    torch.manual_seed(0)
    target = torch.randn(16, 16) / 4
    model = torch.nn.Sequential(BitLinear(16, 64, input_norm=True), torch.nn.SiLU(),
                                BitLinear(64, 16, input_norm=True))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.randn(512, 16)
    losses = []
    for step in range(60):
        batch = data[(step * 64) % 512:][:64]
        loss = F.mse_loss(model(batch), batch @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:5]) / 5, losses


def test_bitnet_spec_swaps_every_linear_without_mutating():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    swapped = bitnet_spec(spec)
    attn = swapped.submodules.self_attention.submodules
    experts = _experts_submodules(swapped)
    assert attn.linear_qkv is BitColumnParallelLinear and attn.linear_proj is BitRowParallelLinear
    assert experts.linear_fc1 is BitColumnParallelLinear
    assert experts.linear_fc2 is BitRowParallelLinear
    assert spec.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert _experts_submodules(spec).linear_fc2 is RowParallelLinear


def _experts_submodules(layer_spec):
    """MoE and experts slots are Megatron 0.19.2 builders (functools.partial)."""
    from megatron_mvmoe.layers.builders import parts

    return parts(parts(layer_spec.submodules.mlp).submodules.experts).submodules


def _tp_pair(rank, world_size, tp):
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.testing.stock_moe import cpu_config

    pg = initialize_layout(ParallelLayout(tp=tp))
    cfg = cpu_config(tensor_model_parallel_size=tp)
    init = torch.nn.init.normal_
    col = BitColumnParallelLinear(16, 32, config=cfg, init_method=init, bias=False,
                                  gather_output=False, tp_group=pg.tp)
    row = BitRowParallelLinear(32, 16, config=cfg, init_method=init, bias=False,
                               input_is_parallel=True, skip_bias_add=True, tp_group=pg.tp)
    gen = torch.Generator().manual_seed(5)
    w1, w2, x = torch.randn(32, 16, generator=gen), torch.randn(16, 32, generator=gen), \
        torch.randn(3, 2, 16, generator=gen)
    shard = 32 // tp
    with torch.no_grad():
        col.weight.copy_(w1[rank * shard:(rank + 1) * shard])
        row.weight.copy_(w2[:, rank * shard:(rank + 1) * shard])
    hidden, _ = col(x)
    out, _ = row(F.silu(hidden) * 3.0)  # scaled: the row input's RMS spans both shards
    out.sum().backward()
    # Reference: full-size BitLinear pair on one process.
    ref1, ref2 = BitLinear(16, 32), BitLinear(32, 16)
    with torch.no_grad():
        ref1.weight.copy_(w1)
        ref2.weight.copy_(w2)
    ref = ref2(F.silu(ref1(x)) * 3.0)
    ref.sum().backward()
    return ((out - ref).abs().max().item(),
            (col.weight.grad - ref1.weight.grad[rank * shard:(rank + 1) * shard]).abs().max().item())


def test_megatron_bit_linears_match_bitlinear_at_tp2():
    for out_err, grad_err in run_distributed(_tp_pair, 2, timeout_s=120, args=(2,)):
        assert out_err < 1e-4 and grad_err < 1e-4
