"""Latent view projections and the gamma ramp."""
import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.views import GammaRamp, MultiViewProjection


def _config(num_views, **kw):
    return MVMoETransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_variant="multi_view" if num_views > 1 else "latent", latent_size=4,
        multi_view=MultiViewConfig(num_routers=num_views, num_views=num_views, view_init_std=0.5),
        use_cpu_initialization=True, add_bias_linear=False, **kw)


def test_views_hand_formula_and_gamma_zero_is_baseline():
    torch.manual_seed(0)
    proj = MultiViewProjection(_config(3))
    assert proj.weight.shape == (4, 8) and proj.view_perturbations.shape == (2, 4, 8)
    hidden_TD = torch.randn(5, 8)
    views_TRL = proj(hidden_TD, gamma=0.3)
    base_TL = hidden_TD @ proj.weight.t()
    torch.testing.assert_close(views_TRL[:, 0], base_TL)
    for m in (1, 2):
        torch.testing.assert_close(
            views_TRL[:, m], base_TL + 0.3 * hidden_TD @ proj.view_perturbations[m - 1].t())
    at_zero = proj(hidden_TD, gamma=0.0)
    assert all(torch.equal(at_zero[:, m], at_zero[:, 0]) for m in range(3))
    assert proj.view_perturbations.std().item() == pytest.approx(0.5, rel=0.3)


def test_single_view_state_dict_is_a_baseline_down_projection():
    torch.manual_seed(0)
    baseline = torch.nn.Linear(8, 4, bias=False)
    single = MultiViewProjection(_config(1))
    single.load_state_dict(baseline.state_dict(), strict=False)
    hidden_TD = torch.randn(3, 8)
    torch.testing.assert_close(single(hidden_TD, 1.0)[:, 0], baseline(hidden_TD))
    multi = MultiViewProjection(_config(2))
    missing, unexpected = multi.load_state_dict(baseline.state_dict(), strict=False)
    assert missing == ["view_perturbations"] and unexpected == []


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_params_tagged_for_tp_grad_reduction(sequence_parallel):
    proj = MultiViewProjection(_config(2, sequence_parallel=sequence_parallel,
                                       tensor_model_parallel_size=2 if sequence_parallel else 1,
                                       expert_tensor_parallel_size=1))
    assert all(p.sequence_parallel is sequence_parallel for p in proj.parameters())


def test_gamma_ramp_values_and_state_round_trip():
    ramp = GammaRamp(4)
    assert [ramp.value(s) for s in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    assert GammaRamp(0).value(0) == 1.0
    ramp.advance(3)
    resumed = GammaRamp(4)
    resumed.load_state_dict(ramp.state_dict())
    assert resumed.value() == 0.75 and resumed.advance() == 1.0
    longer = GammaRamp(8)  # a resume with another ramp: the step is kept, the length is new
    longer.load_state_dict(ramp.state_dict())
    assert (longer.step, longer.value()) == (3, 0.375)
    with pytest.raises(ValueError, match="gamma_ramp_steps"):
        GammaRamp(-1)
