"""Compiled Triton kernels on a GPU against the torch references, fp32 and bf16.

Legend: T tokens, E experts, R routing heads (= views), S slots, L latent, N rows.
Skipped without CUDA (tests/conftest.py). The compiled kernels are chosen by the tensors'
device, whatever TRITON_INTERPRET says (mvmoe_kernels/backend.py decorates once per mode).
"""
import pytest
import torch

from mvmoe_kernels import expert_major_rows, fused_multi_router, mix_and_permute

pytestmark = pytest.mark.gpu

TOLS = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _grads(fn, inputs, seed=1):
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, device=o.device, generator=gen)).sum()
               for o in outs if o.is_floating_point())
    return outs, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,k,num_experts",
                         [(1, 8, 64), (2, 8, 256), (4, 2, 60), (2, 1, 32)])
def test_fused_multi_router_gpu(dtype, num_heads, k, num_experts):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits_TRE = torch.randn(4099, num_heads, num_experts, device=device, generator=gen).to(dtype)
    bias_E = torch.linspace(-0.1, 0.1, num_experts, device=device)
    alpha_E = torch.linspace(0.5, 1.5, num_experts, device=device)
    results = {}
    for backend in ("triton", "reference"):
        logits = logits_TRE.clone().requires_grad_()
        alpha = alpha_E.clone().requires_grad_()
        results[backend] = _grads(
            lambda: tuple(fused_multi_router(logits, bias_E, k, alpha, backend=backend)),
            [logits, alpha])
    (out_k, grads_k), (out_r, grads_r) = results["triton"], results["reference"]
    same_TS = (out_k[0] == out_r[0]).all(dim=1)  # sigmoid ulps may flip exact near-ties
    assert same_TS.float().mean() > 0.999
    tol = TOLS[torch.float32]  # routing maths is fp32 in both, whatever the logits' dtype
    for a, b in zip(out_k[1:3], out_r[1:3]):
        torch.testing.assert_close(a[same_TS], b[same_TS], **tol)
    torch.testing.assert_close(out_k[3], out_r[3], **tol)
    if bool(same_TS.all()):
        torch.testing.assert_close(grads_k[0], grads_r[0], **TOLS[dtype])
        torch.testing.assert_close(grads_k[1], grads_r[1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_views,k,latent", [(1, 8, 128), (2, 8, 512), (4, 2, 200)])
def test_mix_and_permute_gpu(dtype, num_views, k, latent):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    num_tokens, num_experts = 2051, 64
    views_TRL = torch.randn(num_tokens, num_views, latent, device=device, generator=gen).to(dtype)
    mix_TSR = torch.rand(num_tokens, k, num_views, device=device, generator=gen)
    mix_TSR = mix_TSR / mix_TSR.sum(-1, keepdim=True)
    scores_TE = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    idx_TS = scores_TE.topk(k, dim=1).indices.sort(dim=1).values
    rows = expert_major_rows(idx_TS, num_experts)
    results = {}
    for backend in ("triton", "reference"):
        views = views_TRL.clone().requires_grad_()
        mix = mix_TSR.clone().requires_grad_()
        results[backend] = _grads(
            lambda: mix_and_permute(views, mix, rows.row_token_N, rows.row_slot_N,
                                    backend=backend), [views, mix])
    (rows_k, grads_k), (rows_r, grads_r) = results["triton"], results["reference"]
    torch.testing.assert_close(rows_k[0], rows_r[0], **TOLS[dtype])
    torch.testing.assert_close(grads_k[0], grads_r[0], **TOLS[dtype])
    # d mix is an fp32 dot of the same values in both (only the summation order differs)
    torch.testing.assert_close(grads_k[1], grads_r[1], atol=1e-3, rtol=1e-3)
