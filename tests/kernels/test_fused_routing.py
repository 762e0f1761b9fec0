"""Fused multi-router kernel (Triton interpreter on CPU) against the torch reference, and the
reference against the project's routing/views modules.

Legend: T tokens, E experts, R routing heads, S slots (top-k).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first used (see backend.py)

import pytest  # noqa: E402
import torch  # noqa: E402

import math  # noqa: E402

from mvmoe_kernels import fused_multi_router, resolve_backend  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
NUM_TOKENS, NUM_EXPERTS = 37, 20  # not a multiple of the block; E not a power of 2


def _logits(num_heads, seed=0, ties=False, num_tokens=NUM_TOKENS, num_experts=NUM_EXPERTS):
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many exactly equal sums across experts
        return torch.randint(-2, 3, (num_tokens, num_heads, num_experts), generator=gen) / 2.0
    return torch.randn(num_tokens, num_heads, num_experts, generator=gen) * 2


def _run_both(logits_TRE, bias_E, k, alpha, eps=1e-6, block_t=16, weights=None):
    """Forward both implementations and backward the same random loss through each."""
    results = []
    for backend in ("triton", "reference"):
        logits = logits_TRE.clone().requires_grad_()
        alpha_in = alpha.clone().requires_grad_() if isinstance(alpha, torch.Tensor) else alpha
        out = fused_multi_router(logits, bias_E, k, alpha_in, eps, backend=backend,
                                 block_t=block_t)
        if weights is None:
            gen = torch.Generator().manual_seed(1)
            weights = [torch.randn(x.shape, generator=gen) for x in out[1:]]
        loss = sum((x * w).sum() for x, w in zip(out[1:], weights))
        inputs = [logits] + ([alpha_in] if isinstance(alpha, torch.Tensor) else [])
        results.append((out, torch.autograd.grad(loss, inputs)))
    return results


def _assert_match(results):
    (out_k, grads_k), (out_r, grads_r) = results
    assert torch.equal(out_k.topk_idx_TS, out_r.topk_idx_TS)
    for name in ("gates_TS", "mix_TSR", "summed_TE"):
        torch.testing.assert_close(getattr(out_k, name), getattr(out_r, name), **TOL)
    for grad_k, grad_r in zip(grads_k, grads_r):
        torch.testing.assert_close(grad_k, grad_r, **TOL)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_hand_computed_case(backend):
    # sigmoid(+-ln 3) = 0.75 / 0.25: every expert sums to 1.0 (a three-way tie), the bias
    # picks expert 2, the tie rule picks expert 0; the mix keeps the heads' opposite views
    third = math.log(3.0)
    logits_TRE = torch.tensor([[[0.0, third, -third], [0.0, -third, third]]])
    out = fused_multi_router(logits_TRE, torch.tensor([0.0, 0.0, 0.1]), 2, backend=backend)
    assert out.topk_idx_TS.tolist() == [[0, 2]]
    torch.testing.assert_close(out.gates_TS, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(out.mix_TSR, torch.tensor([[[0.5, 0.5], [0.25, 0.75]]]))
    torch.testing.assert_close(out.summed_TE, torch.ones(1, 3))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_kernel_matches_reference(num_heads, k):
    bias_E = torch.linspace(-0.3, 0.3, NUM_EXPERTS)
    alpha_E = torch.linspace(0.5, 2.0, NUM_EXPERTS)
    _assert_match(_run_both(_logits(num_heads, seed=k), bias_E, k, alpha_E))


@pytest.mark.parametrize("num_heads,k", [(1, 2), (2, 8), (4, 1)])
def test_ties_go_to_the_lower_expert_id(num_heads, k):
    results = _run_both(_logits(num_heads, ties=True), torch.zeros(NUM_EXPERTS), k, 1.0)
    _assert_match(results)
    idx_TS = results[0][0].topk_idx_TS
    assert bool((idx_TS[:, 1:] > idx_TS[:, :-1]).all()), "slots must ascend by expert id"


def test_all_equal_scores_pick_the_first_k_experts():
    logits_TRE = torch.zeros(5, 2, NUM_EXPERTS)
    out = fused_multi_router(logits_TRE, None, 3, backend="triton")
    assert out.topk_idx_TS.tolist() == [[0, 1, 2]] * 5


@pytest.mark.parametrize("alpha", [1.0, 1.7, "scalar_tensor"])
def test_alpha_forms(alpha):
    alpha = torch.tensor(0.8) if alpha == "scalar_tensor" else alpha
    _assert_match(_run_both(_logits(2, seed=3), torch.zeros(NUM_EXPERTS), 2, alpha))


def test_bias_changes_selection_not_gates():
    logits_TRE = _logits(2, seed=4)
    plain = fused_multi_router(logits_TRE, None, 2, backend="triton")
    bias_E = torch.zeros(NUM_EXPERTS)
    bias_E[plain.topk_idx_TS[0, 0]] = -100.0  # push token 0's first choice out
    biased = fused_multi_router(logits_TRE, bias_E, 2, backend="triton")
    assert not torch.equal(plain.topk_idx_TS[0], biased.topk_idx_TS[0])
    sums = biased.summed_TE[0, biased.topk_idx_TS[0]]
    torch.testing.assert_close(biased.gates_TS[0], sums / sums.sum(), **TOL)


def test_gate_floor_eps_and_underflow_fallback():
    # sums far below eps: the floor is active (and passes no gradient); -200 underflows the
    # sigmoid to exactly 0 for every head, so the mix must fall back to uniform 1/R
    logits_TRE = torch.full((6, 2, NUM_EXPERTS), -20.0)
    logits_TRE[3:] = -200.0
    logits_TRE[:, :, 5] += torch.tensor([0.5, -0.5])
    results = _run_both(logits_TRE, torch.zeros(NUM_EXPERTS), 2, 1.0, eps=1e-6)
    _assert_match(results)
    mix_TSR = results[0][0].mix_TSR
    assert torch.equal(mix_TSR[3:], torch.full_like(mix_TSR[3:], 0.5))
    assert all(torch.isfinite(g).all() for g in results[0][1])


def test_unused_outputs_count_as_zero_gradient():
    logits = _logits(2, seed=5).requires_grad_()
    grads = []
    for backend in ("triton", "reference"):
        out = fused_multi_router(logits, None, 2, 1.0, backend=backend)
        grads.append(torch.autograd.grad(out.gates_TS.pow(2).sum(), logits)[0])
    torch.testing.assert_close(grads[0], grads[1], **TOL)


def test_single_program_and_many_programs_agree():
    logits_TRE = _logits(2, seed=6)
    big = fused_multi_router(logits_TRE, None, 2, backend="triton", block_t=64)
    small = fused_multi_router(logits_TRE, None, 2, backend="triton", block_t=8)
    for a, b in zip(big, small):
        assert torch.equal(a, b)


def test_reference_matches_project_routing_and_views():
    routing = pytest.importorskip("megatron_mvmoe.routing")
    views = pytest.importorskip("megatron_mvmoe.views")
    for num_heads, k in ((1, 1), (2, 1), (2, 2), (4, 8)):
        logits = _logits(num_heads, seed=10 + k).requires_grad_()
        bias_E = torch.linspace(0.2, -0.2, NUM_EXPERTS)
        alpha_E = torch.linspace(0.5, 1.5, NUM_EXPERTS).requires_grad_()
        for backend in ("reference", "triton"):
            scores_TRE = routing.sigmoid_scores(logits)
            summed_TE = routing.sum_over_routers(scores_TRE)
            idx_TS = routing.select_topk(summed_TE, bias_E, k)
            theirs = (routing.gates(summed_TE, idx_TS, alpha_E, 1e-6, num_routers=num_heads),
                      views.mixing_weights(scores_TRE, idx_TS), summed_TE)
            ours = fused_multi_router(logits, bias_E, k, alpha_E, 1e-6, backend=backend)
            assert torch.equal(ours.topk_idx_TS, idx_TS)
            gen = torch.Generator().manual_seed(2)
            weights = [torch.randn(x.shape, generator=gen) for x in theirs]
            grads = [torch.autograd.grad(sum((x * w).sum() for x, w in zip(outs, weights)),
                                         [logits, alpha_E]) for outs in (ours[1:], theirs)]
            for a, b in zip(ours[1:], theirs):
                torch.testing.assert_close(a, b, **TOL)
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, **TOL)


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("MVMOE_KERNELS", "reference")
    assert resolve_backend(None, cpu) == "reference"
    assert resolve_backend("triton", cpu) == "triton"  # the argument wins over the variable
    monkeypatch.setenv("MVMOE_KERNELS", "auto")
    assert resolve_backend(None, cpu) == "reference"  # auto never interprets on CPU
    monkeypatch.setenv("MVMOE_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="MVMOE_KERNELS"):
        resolve_backend(None, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", cpu)


@pytest.mark.parametrize("bad,match", [
    (dict(logits_TRE=torch.zeros(4, 20)), "logits_TRE"),
    (dict(logits_TRE=torch.zeros(4, 2, 20, dtype=torch.int32)), "logits_TRE"),
    (dict(bias_E=torch.zeros(19)), "bias_E"),
    (dict(k=0), "k"),
    (dict(k=21), "k"),
    (dict(alpha=torch.ones(3)), "alpha"),
    (dict(eps=0.0), "eps"),
    (dict(block_t=12), "block_t"),
])
def test_clear_errors(bad, match):
    args = dict(logits_TRE=torch.zeros(4, 2, 20), bias_E=torch.zeros(20), k=2, alpha=1.0,
                eps=1e-6, block_t=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fused_multi_router(**args, backend="triton")
