"""GroupedMatmulExperts (layers/grouped_experts.py) against Megatron's SequentialMLP.

- The same weights give the same outputs and gradients (every parameter, the input, the
  routing probs) within 1e-6 in fp32: the expert module alone with uneven and zero token
  counts, SwiGLU and GeLU; whole latent / Multi-View layers with an expert that receives no
  token (its expert bias pushed far down); Multi-View at EP = 2 over gloo.
- The grouped path really runs (torch._grouped_mm is called) and the fallback names why.
- Checkpoints: the sharded state dict (keys, global shapes and offsets, at EP = 2 too) is
  SequentialMLP's, so dist-checkpoints of either load into the other.
- The fast-path rule turns it on on CPU and off with a reason under BitNet, on a GPU and
  for dense models; the provider's config carries the decision. Its measured criterion
  (one expert's I x F at most GROUPED_MM_MAX_EXPERT_ELEMENTS) keeps the tiny presets on the
  grouped path and puts the real-width 10B-A1B (I x F = 256 x 3968) on SequentialMLP's
  loop, with the numbers in the reason; the decoder block's MoE spec follows it.
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_mvmoe.layers.builders import build, parts
from megatron_mvmoe.layers.grouped_experts import (GroupedMatmulExperts, grouped_experts_spec,
                                                   grouped_mm_runs_here, with_grouped_experts)
from megatron_mvmoe.models.fast_paths import Target, choose_fast_paths, is_on
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.testing.stock_moe import sigmoid_moe_config

from layer_utils import (build_layer, ep_layer, global_input, global_weights,
                         load_global_weights, mv_config, named_grads)

TOL = dict(atol=1e-6, rtol=0)
NEVER_ROUTED = 5
"""Global expert id whose expert bias is pushed down so that it receives zero tokens."""


def _expert_pair(pgs, **config_overrides):
    config = sigmoid_moe_config(**config_overrides)
    spec = parts(get_moe_module_spec(use_te=False, num_experts=8)).submodules.experts
    torch.manual_seed(0)
    sequential = build(spec, 4, config, pg_collection=pgs)
    grouped = build(grouped_experts_spec(spec), 4, config, pg_collection=pgs)
    grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def _run_experts(module, rows, counts, probs, grad):
    rows = rows.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(rows, counts, probs)
    out.backward(grad)
    return {"out": out.detach(), "rows": rows.grad, "probs": probs.grad,
            **{name: p.grad for name, p in module.named_parameters()}}


def _experts_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    gen = torch.Generator().manual_seed(1)
    results = []
    # the last: Megatron's compiled SwiGLU, SequentialMLP's MLPs against the grouped call
    for glu, act, fused in ((True, F.silu, False), (False, F.gelu, False), (True, F.silu, True)):
        sequential, grouped = _expert_pair(pgs, gated_linear_unit=glu, activation_func=act,
                                           bias_activation_fusion=fused)
        counts = torch.tensor([3, 0, 5, 1])  # uneven, one expert without rows
        rows = torch.randn(9, 32, generator=gen)
        probs, grad = torch.rand(9, generator=gen), torch.randn(9, 32, generator=gen)
        results.append((grouped.grouped_unsupported(rows),
                        _run_experts(sequential, rows, counts, probs, grad),
                        _run_experts(grouped, rows, counts, probs, grad)))
    return results


def test_expert_module_matches_sequential_mlp_with_uneven_and_empty_experts():
    for why_not, want, got in run_distributed(_experts_worker, 1)[0]:
        assert why_not is None
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
        assert got["local_experts.1.linear_fc1.weight"].abs().sum() == 0  # no rows, no grad


def _count_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    _, grouped = _expert_pair(pgs)
    grouped_mm_runs_here(torch.float32)  # the probe (cached) runs before counting starts
    calls, original = [], torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch._grouped_mm = counted  # this rank's process only; it exits after the test
    rows = torch.randn(6, 32)
    grouped(rows, torch.tensor([2, 2, 2, 0]), torch.rand(6))
    return len(calls), grouped.grouped_unsupported(rows.new_empty(0, 32))


def test_grouped_path_calls_grouped_mm_and_falls_back_with_a_reason():
    assert grouped_mm_runs_here(), "torch 2.13 runs _grouped_mm on CPU (fp32, with backward)"
    calls, why = run_distributed(_count_worker, 1)[0]
    assert calls == 2  # fc1 and fc2: one call each for all local experts
    assert why == "no rows"


def _layer_run(pgs, variant, grouped, ep=1):
    overrides = dict(cpu_grouped_experts=grouped)
    if ep > 1:
        config, layer = ep_layer(variant, pgs, ep, **overrides)
    else:
        config = mv_config(variant, num_routers=1 if variant == "latent" else 2, **overrides)
        layer = build_layer(config, pgs)
        load_global_weights(layer, global_weights(config))
    with torch.no_grad():
        layer.router.expert_bias[NEVER_ROUTED] = -1e4
    x = global_input(config.hidden_size).requires_grad_(True)
    out, _ = layer(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight).sum().backward()
    return {"experts": type(layer.experts).__name__, "out": out.detach(), "x": x.grad,
            "grads": named_grads(layer),
            "sharded": _sharded_layout(layer.experts)}


def _sharded_layout(experts):
    """{key: (global shape, global offset)} of the experts' sharded state dict."""
    return {key: (tuple(t.global_shape), tuple(t.global_offset))
            for key, t in experts.sharded_state_dict(prefix="experts.").items()}


def _layers_worker(rank, world_size, variants):
    from layer_utils import init_ep_layout

    pgs = init_ep_layout(world_size)
    return {v: [_layer_run(pgs, v, grouped, ep=world_size) for grouped in (False, True)]
            for v in variants}


def _assert_same(runs):
    for variant, (want, got) in runs.items():
        assert (want["experts"], got["experts"]) == ("SequentialMLP", "GroupedMatmulExperts")
        torch.testing.assert_close(got["out"], want["out"], **TOL, msg=variant)
        torch.testing.assert_close(got["x"], want["x"], **TOL, msg=variant)
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], **TOL,
                                       msg=f"{variant} {name}")
        assert got["sharded"] == want["sharded"], "checkpoint layout differs"
        zero = [g for n, g in got["grads"].items() if n.startswith(f"experts.{NEVER_ROUTED}.")]
        assert all(g.abs().sum() == 0 for g in zero)


def test_latent_and_multi_view_layers_match_sequential_mlp():
    _assert_same(run_distributed(_layers_worker, 1, args=(("latent", "multi_view"),))[0])


def test_multi_view_at_ep2_matches_sequential_mlp_on_every_rank():
    results = run_distributed(_layers_worker, 2, args=(("multi_view",),))
    for runs in results:
        _assert_same(runs)
    keys = [set(r["multi_view"][1]["sharded"]) for r in results]
    assert keys[0] == keys[1]  # same global keys, each rank its own expert offsets
    offsets = [{v[1] for v in r["multi_view"][1]["sharded"].values()} for r in results]
    assert offsets[0].isdisjoint(offsets[1])


def test_fast_path_rule_and_provider_config():
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.provider import transformer_config

    cpu = Target(cuda=False, te=False)
    assert is_on(choose_fast_paths(cpu, "multi_view"), "cpu_grouped_experts")
    for paths, reason in ((choose_fast_paths(cpu, "multi_view", bitnet=True), "BitNet"),
                          (choose_fast_paths(Target(cuda=True, te=True), "latent"), "GPU"),
                          (choose_fast_paths(cpu, "dense"), "dense")):
        path = next(p for p in paths if p.name == "cpu_grouped_experts")
        assert not path.on and reason in path.why
    config = transformer_config(model_from_preset("tiny_multi_view"), on_cpu=True)
    assert config.cpu_grouped_experts is True
    bitnet = model_from_preset("tiny_multi_view", bitnet=dict(enabled=True))
    assert transformer_config(bitnet, on_cpu=True).cpu_grouped_experts is False


def test_measured_criterion_picks_the_faster_expert_path():
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models import fast_paths as fp
    from megatron_mvmoe.models.provider import transformer_config

    cpu, limit = Target(cuda=False, te=False), fp.GROUPED_MM_MAX_EXPERT_ELEMENTS
    for elements, on in ((limit, True), (limit + 1, False), (None, True)):
        path = next(p for p in choose_fast_paths(cpu, "latent", expert_elements=elements)
                    if p.name == "cpu_grouped_experts")
        assert path.on is on and fp.config_fields([path]) == {"cpu_grouped_experts": on}
    real = model_from_preset("mvmoe_10b_a1b", num_layers=1)
    assert fp.expert_matrix_elements(real) == 256 * 3968  # latent L x expert FFN F
    assert fp.expert_matrix_elements(real, etp=2) == 256 * 1984
    mh = model_from_preset("tiny_mh_moe")
    assert fp.expert_matrix_elements(mh) == (
        mh.hidden_size // mh.multi_head.num_heads * mh.moe_ffn_hidden_size)
    off = next(p for p in choose_fast_paths(cpu, "multi_view",
                                            expert_elements=fp.expert_matrix_elements(real))
               if p.name == "cpu_grouped_experts")
    assert not off.on and f"I x F = {256 * 3968} > {limit}" in off.why
    tiny = model_from_preset("tiny_multi_view")
    assert fp.expert_matrix_elements(tiny) <= limit
    for section, grouped in ((tiny, True), (real, False)):
        config = transformer_config(section, on_cpu=True)
        assert config.cpu_grouped_experts is grouped
        spec = get_moe_module_spec(use_te=False, num_experts=8)
        built = parts(parts(with_grouped_experts(spec, config)).submodules.experts).module
        assert built is (GroupedMatmulExperts if grouped else SequentialMLP)


@pytest.mark.parametrize("impl", [SequentialMLP, GroupedMatmulExperts])
def test_experts_spec_keeps_sequential_mlp_parameters(impl):
    spec = parts(get_moe_module_spec(use_te=False, num_experts=8)).submodules.experts
    grouped = grouped_experts_spec(spec)
    assert parts(grouped).submodules == parts(spec).submodules
    assert issubclass(parts(grouped).module, impl)
