"""The Multi-View layer on the fused kernels (mvmoe_kernels: multi-router routing in
MultiRouter, mix-and-permute in the layer) vs the torch path.

- expert_major_rows gives exactly the per-row dispatcher's permute order (tokens and slots).
- kernels="triton" (Triton interpreter on CPU, TRITON_INTERPRET=1) equals kernels="reference":
  outputs, input and parameter gradients within 1e-5, for R = 2 (gamma = 1), the stop-grad
  ablation, k = 1 and R = K = 1; at gamma = 0 within 1e-6 (gate rounding only).
- the backend is resolved once, when the layer is built: "auto" is the torch path on CPU
  (MVMOE_KERNELS can force the kernel), a bad name is refused naming multi_view.kernels, and
  "triton" on CPU without the interpreter fails at build with a fix.
The interpreter is slow, so sizes are tiny (12 tokens, 8 experts).
"""

import importlib.util

import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig
from megatron_mvmoe.layers.per_row_dispatcher import permute_rows
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import (build_layer, global_input, global_weights, load_global_weights,
                         mv_config, named_grads)

mvmoe_kernels = pytest.importorskip("mvmoe_kernels")
if importlib.util.find_spec("triton") is None:  # not importorskip: see _interpreted
    pytest.skip("triton is not installed", allow_module_level=True)


def _interpreted(worker, monkeypatch):
    """Run `worker` on one rank in a FRESH interpreter with TRITON_INTERPRET=1: Triton's
    interpreter only works if the variable is set before triton is imported, and this
    process imported it already (Megatron does), so a forked child would inherit that."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return run_distributed(worker, 1, timeout_s=300, start_method="spawn")[0]


def test_expert_major_rows_is_the_dispatchers_permute_order():
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, k = 37, 8, 3
    topk_idx_TS = torch.sort(torch.rand(num_tokens, num_experts, generator=gen)
                             .topk(k, dim=1).indices, dim=1).values
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(
        1, topk_idx_TS, True)
    # row (t, s) carries its own flat id, so the permuted rows reveal the order
    ids_TS1 = torch.arange(num_tokens * k, dtype=torch.float32).view(num_tokens, k, 1)
    permuted_N1, _, token_ids_N = permute_rows(ids_TS1, routing_map_TE,
                                               routing_map_TE.float())
    order = mvmoe_kernels.expert_major_rows(topk_idx_TS, num_experts)
    assert torch.equal(order.row_token_N * k + order.row_slot_N, permuted_N1[:, 0].long())
    assert torch.equal(order.row_token_N, token_ids_N)
    assert torch.equal(order.tokens_per_expert_E, routing_map_TE.sum(0))


def _run(pgs, kernels, device=None, **config_kwargs):
    config = mv_config("multi_view", **config_kwargs)
    config.multi_view.kernels = kernels
    layer = build_layer(config, pgs)
    load_global_weights(layer, global_weights(config))
    layer.to(device)
    seen = []
    original = layer.token_dispatcher.dispatch_preprocess_permuted
    layer.token_dispatcher.dispatch_preprocess_permuted = lambda *a: (
        seen.append(True), original(*a))[1]
    x = global_input(config.hidden_size).to(device).requires_grad_(True)
    out, _ = layer(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight.to(out.device)).sum().backward()
    grads = {name: grad.cpu() for name, grad in named_grads(layer).items()}
    return {"out": out.detach().cpu(), "x_grad": x.grad.detach().cpu(), "grads": grads,
            "fused": bool(seen), "backend": layer.kernel_backend}


CASES = {
    "r2": dict(num_routers=2),
    "r2_stop_grad": dict(num_routers=2, stop_grad_mixing=True),
    "r3_k1": dict(num_routers=3, moe_router_topk=1),
    "r1": dict(num_routers=1),
    "r2_gamma0": dict(num_routers=2, ramp_steps=10),
}


def _parity_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    return {name: {k: _run(pgs, k, **kw) for k in ("triton", "reference")}
            for name, kw in CASES.items()}


def test_triton_layer_equals_reference_layer(monkeypatch):
    _check_parity(_interpreted(_parity_worker, monkeypatch), atol=1e-5)


def _gpu_worker(rank, world_size):
    from megatron_mvmoe.platform import device, set_local_device

    set_local_device(rank)
    pgs = initialize_layout(ParallelLayout())
    results = {name: {k: _run(pgs, k, device=device(), **kw) for k in ("auto", "reference")}
               for name, kw in CASES.items()}
    for runs in results.values():
        runs["triton"] = runs.pop("auto")  # auto on CUDA must pick the compiled kernel
    return results


@pytest.mark.gpu
def test_compiled_triton_layer_equals_reference_layer_on_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MVMOE_KERNELS", raising=False)
    results = run_distributed(_gpu_worker, 1, timeout_s=300, start_method="spawn")[0]
    _check_parity(results, atol=1e-4)  # GPU GEMMs may reorder sums


def _check_parity(results, atol):
    for name, runs in results.items():
        fused, ref = runs["triton"], runs["reference"]
        assert fused["fused"] and not ref["fused"], name  # each took its own path
        torch.testing.assert_close(fused["out"], ref["out"], atol=atol, rtol=atol, msg=name)
        torch.testing.assert_close(fused["x_grad"], ref["x_grad"], atol=atol, rtol=atol,
                                   msg=name)
        assert fused["grads"].keys() == ref["grads"].keys(), name
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(fused["grads"][param], grad, atol=atol, rtol=atol,
                                       msg=f"{name} {param}")
    # gamma = 0: every row is P h on both paths; the outputs then differ only by the fused
    # routing kernel's gate rounding (its fp32 sums run in another order than torch's)
    torch.testing.assert_close(results["r2_gamma0"]["triton"]["out"],
                               results["r2_gamma0"]["reference"]["out"], atol=1e-6, rtol=0)
    # the ablation really cuts the mixing gradient (router grads change)
    assert not torch.allclose(results["r2_stop_grad"]["triton"]["grads"]["router.weight"],
                              results["r2"]["triton"]["grads"]["router.weight"])


def _choice_worker(rank, world_size):
    import os

    pgs = initialize_layout(ParallelLayout())
    out = {"auto": build_layer(mv_config("multi_view"), pgs).kernel_backend}
    os.environ["MVMOE_KERNELS"] = "reference"
    out["env_reference"] = build_layer(mv_config("multi_view"), pgs).kernel_backend
    del os.environ["MVMOE_KERNELS"]
    config = mv_config("multi_view")
    config.multi_view.kernels = "triton"
    try:  # refused at build, before any forward
        build_layer(config, pgs)
        out["triton_no_interpreter"] = None
    except ValueError as exc:
        out["triton_no_interpreter"] = str(exc)
    return out


def test_backend_choice_and_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MVMOE_KERNELS", raising=False)
    out = run_distributed(_choice_worker, 1)[0]
    assert out["auto"] == "reference" and out["env_reference"] == "reference"
    assert "TRITON_INTERPRET" in out["triton_no_interpreter"]
    with pytest.raises(ValueError, match=r"multi_view\.kernels"):
        mv_config("multi_view", multi_view=MultiViewConfig(num_routers=2, num_views=2,
                                                           kernels="cuda"))
