"""Single-process invariants of the latent, Multi-Router and Multi-View layers (seed 000).

- R = K = 1 reproduces the baseline latent MoE built on Megatron's own TopKRouter
  (sigmoid + expert bias): same probs, routing map, output and gradients within 1e-6.
- gamma = 0: Multi-View outputs equal Multi-Router outputs exactly.
- The experts receive E(sum_m a_m v_m): the rows entering the experts equal a naive
  per-(token, expert) blend, and the output equals a naive reference of Eq. 5 (and not
  the sum a E(v) alternative).
- The gamma ramp is checkpointed in the layer's state dict; another length resumes at its step.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import (build_layer, global_input, global_weights, load_global_weights,
                         mv_config, named_grads)


def _forward_backward(layer, x):
    x = x.clone().requires_grad_(True)
    probs, routing_map = layer.router(x.detach().reshape(-1, x.shape[-1]))
    out, _ = layer(x)
    # a fixed linear loss keeps gradients O(1), so 1e-6 is a meaningful fp32 tolerance
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight).sum().backward()
    return {"probs": probs.detach(), "map": routing_map, "out": out.detach(),
            "x_grad": x.grad.detach(), "grads": named_grads(layer)}


def _run_variant(pgs, variant, num_routers, ramp_steps=0, weights_from=None):
    config = mv_config(variant, num_routers=num_routers, ramp_steps=ramp_steps)
    layer = build_layer(config, pgs)
    load_global_weights(layer, global_weights(weights_from or config))
    return _forward_backward(layer, global_input(config.hidden_size))


def _r1_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    return {v: _run_variant(pgs, v, 1) for v in ("latent", "multi_router", "multi_view")}


def _gamma0_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    weights_config = mv_config("multi_view", num_routers=2)
    return {"multi_router": _run_variant(pgs, "multi_router", 2, weights_from=weights_config),
            "multi_view": _run_variant(pgs, "multi_view", 2, ramp_steps=10)}


def test_r1_reproduces_megatron_sigmoid_expert_bias_baseline():
    runs = run_distributed(_r1_worker, 1)[0]
    base = runs["latent"]
    assert base["map"].sum(1).eq(3).all()
    for variant in ("multi_router", "multi_view"):
        run = runs[variant]
        assert torch.equal(run["map"], base["map"]), variant
        torch.testing.assert_close(run["probs"], base["probs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(run["out"], base["out"], atol=1e-6, rtol=0)
        torch.testing.assert_close(run["x_grad"], base["x_grad"], atol=1e-6, rtol=1e-6)
        for name, grad in base["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, atol=1e-6, rtol=1e-6,
                                       msg=f"{variant} {name}")


def test_gamma_zero_multi_view_equals_multi_router_exactly():
    runs = run_distributed(_gamma0_worker, 1)[0]
    mr, mv = runs["multi_router"], runs["multi_view"]
    assert torch.equal(mv["map"], mr["map"])
    assert torch.equal(mv["out"], mr["out"])
    for name, grad in mr["grads"].items():
        torch.testing.assert_close(mv["grads"][name], grad, atol=1e-6, rtol=1e-6, msg=name)


# ---- E(sum a v), checked against a naive reference --------------------------------------
def _naive(weights, config, x_TD, gamma, mix_first=True):
    """Eq. 5 by hand, per token and selected expert. mix_first=False: sum_m a E(v_m)."""
    mv = config.multi_view
    E, R, k = config.num_moe_experts, mv.num_routers, config.moe_router_topk
    scores_TRE = torch.sigmoid(x_TD @ weights["router"].t()).view(-1, R, E)
    summed_TE = scores_TRE.sum(1)
    views_TRL = [x_TD @ weights["down"].t()]
    for m in range(R - 1):
        views_TRL.append(views_TRL[0] + gamma * (x_TD @ weights["dP"][m].t()))
    views_TRL = torch.stack(views_TRL, 1)
    rows, out = {}, torch.zeros(x_TD.shape[0], config.latent_size)

    def expert(e, v):
        return F.gelu(v @ weights["fc1"][e].t()) @ weights["fc2"][e].t()

    for t in range(x_TD.shape[0]):
        chosen = sorted(torch.topk(summed_TE[t] + weights["expert_bias"], k).indices.tolist())
        norm = summed_TE[t, chosen].sum()
        for e in chosen:
            a_R = scores_TRE[t, :, e] / scores_TRE[t, :, e].sum()
            row = (a_R.unsqueeze(1) * views_TRL[t]).sum(0)
            rows[(e, t)] = row
            y = expert(e, row) if mix_first else sum(a_R[m] * expert(e, views_TRL[t, m])
                                                     for m in range(R))
            out[t] += summed_TE[t, e] / norm * y
    return rows, out @ weights["up"].t()


def _rows_worker(rank, world_size):
    config = mv_config("multi_view", num_routers=2)
    layer = build_layer(config, initialize_layout(ParallelLayout()))
    weights = global_weights(config)
    load_global_weights(layer, weights)
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(
        (args[0].detach().clone(), args[1].clone())))
    x = global_input(config.hidden_size)
    out, _ = layer(x)
    rows_ref, out_ref = _naive(weights, config, x.reshape(-1, config.hidden_size), 1.0)
    _, out_post = _naive(weights, config, x.reshape(-1, config.hidden_size), 1.0, False)
    return seen[0], rows_ref, out.detach(), out_ref.view_as(out), out_post.view_as(out)


def test_experts_see_mixed_rows_and_output_matches_eq5():
    (rows_NL, tokens_per_expert), rows_ref, out, out_ref, out_post = run_distributed(
        _rows_worker, 1)[0]
    expected, offset = [], 0
    for e, count in enumerate(tokens_per_expert.tolist()):
        tokens = sorted(t for (ee, t) in rows_ref if ee == e)
        assert len(tokens) == count
        expected += [rows_ref[(e, t)] for t in tokens]
        offset += count
    torch.testing.assert_close(rows_NL, torch.stack(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    assert (out - out_post).abs().max() > 1e-3  # E(sum a v) differs from sum a E(v) here


# ---- gamma ramp state ----------------------------------------------------------------------
def _ramp_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    layer = build_layer(mv_config("multi_view", num_routers=2, ramp_steps=4), pgs)
    gammas = [layer.gamma()] + [layer.advance_gamma() for _ in range(3)]
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    resumed = build_layer(mv_config("multi_view", num_routers=2, ramp_steps=4), pgs)
    resumed.load_state_dict(state)
    longer = build_layer(mv_config("multi_view", num_routers=2, ramp_steps=8), pgs)
    longer.load_state_dict(state)
    return gammas, resumed.gamma(), longer.gamma()


def test_gamma_ramp_is_checkpointed_and_resumes():
    """The ramp's step is checkpointed; a resume with another ramp length keeps the step and
    ramps on at the new length (issue 35: the ramp may change on resume, named in the log)."""
    gammas, resumed_gamma, longer_gamma = run_distributed(_ramp_worker, 1)[0]
    assert gammas == [0.0, 0.25, 0.5, 0.75]
    assert resumed_gamma == 0.75
    assert longer_gamma == 3 / 8
