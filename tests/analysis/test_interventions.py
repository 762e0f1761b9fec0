"""Mixing interventions on a real MultiViewMoELayer: identity gives ΔNLL exactly 0, the other
policies change the NLL while selection and gates stay exactly fixed."""
import pytest
import torch

from megatron_mvmoe.analysis.routing.interventions import POLICIES, replace_mixing
from megatron_mvmoe.testing.spawn import run_distributed


def test_replace_mixing_policies():
    mix = torch.tensor([[[0.7, 0.3], [0.2, 0.8]]])
    assert torch.equal(replace_mixing(mix, "identity"), mix)
    assert replace_mixing(mix, "view1").tolist() == [[[1.0, 0.0], [1.0, 0.0]]]
    assert replace_mixing(mix, "view2").tolist() == [[[0.0, 1.0], [0.0, 1.0]]]
    assert replace_mixing(mix, "uniform").tolist() == [[[0.5, 0.5], [0.5, 0.5]]]
    assert torch.allclose(replace_mixing(mix, "swapped"), torch.tensor([[[0.3, 0.7], [0.8, 0.2]]]))
    with pytest.raises(ValueError, match="view3"):
        replace_mixing(mix, "view3")
    with pytest.raises(ValueError, match="unknown"):
        replace_mixing(mix, "bogus")


def _interventions_rank(rank, world_size):
    from megatron_mvmoe.analysis.routing.interventions import override_mixing, run_interventions
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches
    import toy_lm

    apply_cpu_patches()
    pg = initialize_layout(ParallelLayout())
    layer = toy_lm.build_layer(toy_lm.toy_config(), pg)
    model = toy_lm.ToyLM(layer)
    data = {"a": toy_lm.batches(2, seed=0), "b": toy_lm.batches(1, seed=1)}
    results = {r.policy: r for r in run_interventions(model, layer, data, toy_lm.token_nll)}
    assert set(results) == set(POLICIES)
    for result in results.values():
        assert result.selection_fixed and result.max_gate_diff == 0.0, result.policy
    for effect in results["identity"].domains:
        assert effect.delta == 0.0
    for policy in ("view1", "view2", "uniform", "swapped"):
        assert any(abs(e.delta) > 1e-6 for e in results[policy].domains), policy
    # the hooks are removed afterwards, and nothing was patched on the instance
    assert layer.mix_transforms == [] and layer.router.observers == []
    assert "route" not in layer.__dict__ and "expert_rows" not in layer.__dict__
    # the override does change what the experts see
    with torch.no_grad(), override_mixing(layer, "view1"):
        out_view1 = toy_lm.token_nll(model, data["a"][0])
    out_base = toy_lm.token_nll(model, data["a"][0]).detach()
    assert not torch.equal(out_view1, out_base)
    return True


def test_identity_exact_and_routing_fixed():
    assert run_distributed(_interventions_rank, 1, timeout_s=120) == [True]


def test_refuses_non_multi_view_layer():
    from megatron_mvmoe.analysis.routing.interventions import override_mixing
    with pytest.raises(ValueError, match="mixes no views"):
        with override_mixing(torch.nn.Linear(2, 2), "identity"):
            pass
