"""Mix-and-permute kernel (Triton interpreter on CPU) against the torch reference; the dispatch
order against Megatron's own permute.

Legend: T tokens, E experts, R views (= routing heads), S slots, L latent, N rows.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first used (see backend.py)

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mvmoe_kernels import (  # noqa: E402
    expert_major_rows,
    mix_and_permute,
    reference_mix_and_permute,
    reference_multi_router,
)
from mvmoe_kernels.backend import interpreter_loop_refusal  # noqa: E402

mix_permute_module = importlib.import_module("mvmoe_kernels.mix_permute")
# Triton 3.6 (the site GPU image's, docs/gpu.md) with numpy >= 2.5 cannot interpret the
# backward kernel's loop; the backward refuses in one line there (tested below)
interpreted_backward = pytest.mark.skipif(interpreter_loop_refusal() is not None,
                                          reason=str(interpreter_loop_refusal()))

TOL = dict(atol=1e-5, rtol=1e-5)
NUM_TOKENS, NUM_EXPERTS, LATENT = 37, 12, 24  # odd T, L not a power of 2


def _case(num_heads, k, seed=0, num_tokens=NUM_TOKENS):
    gen = torch.Generator().manual_seed(seed)
    logits_TRE = torch.randn(num_tokens, num_heads, NUM_EXPERTS, generator=gen)
    routed = reference_multi_router(logits_TRE, torch.zeros(NUM_EXPERTS), k)
    views_TRL = torch.randn(num_tokens, num_heads, LATENT, generator=gen)
    return views_TRL, routed.mix_TSR, routed.topk_idx_TS


def _run_both(views_TRL, mix_TSR, row_token_N, row_slot_N, **kwargs):
    results = []
    for backend in ("triton", "reference"):
        views = views_TRL.clone().requires_grad_()
        mix = mix_TSR.clone().requires_grad_()
        rows_NL = mix_and_permute(views, mix, row_token_N, row_slot_N, backend=backend,
                                  **kwargs)
        weight_NL = torch.randn(rows_NL.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((rows_NL * weight_NL).sum(), [views, mix])
        results.append((rows_NL, grads))
    return results


def _assert_match(results):
    (rows_k, grads_k), (rows_r, grads_r) = results
    torch.testing.assert_close(rows_k, rows_r, **TOL)
    for grad_k, grad_r in zip(grads_k, grads_r):
        torch.testing.assert_close(grad_k, grad_r, **TOL)


@interpreted_backward
@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_kernel_matches_reference(num_heads, k):
    views_TRL, mix_TSR, idx_TS = _case(num_heads, k, seed=k)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    _assert_match(_run_both(views_TRL, mix_TSR, rows.row_token_N, rows.row_slot_N))


def test_row_is_the_blend_of_its_token_and_slot():
    # hand-computed: one token, two views, two slots
    views_TRL = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 4.0, -2.0]]])
    mix_TSR = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    rows_NL = mix_and_permute(views_TRL, mix_TSR, torch.tensor([0, 0]), torch.tensor([1, 0]),
                              backend="triton")
    assert rows_NL.tolist() == [[1.0, 0.0, 2.0], [0.25, 3.0, -1.0]]


def test_order_is_megatrons_permute_order():
    from megatron.core.transformer.moe.moe_utils import permute

    views_TRL, mix_TSR, idx_TS = _case(2, 3, seed=7)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    routing_map_TE = torch.zeros(NUM_TOKENS, NUM_EXPERTS, dtype=torch.bool).scatter(1, idx_TS, True)
    token_ids_T1 = torch.arange(NUM_TOKENS, dtype=torch.float32).unsqueeze(1)
    # 0.19.2: five outputs, and the unfused path needs the row count up front
    permuted_N1, _, sorted_indices_N, _, _ = permute(
        token_ids_T1, routing_map_TE, num_out_tokens=int(routing_map_TE.sum()))
    assert torch.equal(rows.row_token_N, sorted_indices_N)
    assert torch.equal(rows.row_token_N.float(), permuted_N1.squeeze(1))
    expert_of_row_N = torch.repeat_interleave(torch.arange(NUM_EXPERTS), rows.tokens_per_expert_E)
    assert torch.equal(idx_TS[rows.row_token_N, rows.row_slot_N], expert_of_row_N)
    assert torch.equal(rows.tokens_per_expert_E, routing_map_TE.sum(0))


def test_matches_project_mix_views_then_permute():
    views = pytest.importorskip("megatron_mvmoe.views")
    views_TRL, mix_TSR, idx_TS = _case(2, 2, seed=8)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    blended_TSL = views.mix_views(views_TRL, mix_TSR)
    expected_NL = blended_TSL[rows.row_token_N, rows.row_slot_N]
    got_NL = mix_and_permute(views_TRL, mix_TSR, rows.row_token_N, rows.row_slot_N,
                             backend="triton")
    torch.testing.assert_close(got_NL, expected_NL, **TOL)


@interpreted_backward
def test_dropped_pairs_and_padding_rows():
    views_TRL, mix_TSR, idx_TS = _case(2, 2, seed=9)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    keep = torch.arange(rows.row_token_N.shape[0]) % 3 != 0  # drop every third pair
    pad = torch.full((5,), -1)
    row_token_N = torch.cat([rows.row_token_N[keep], pad])
    row_slot_N = torch.cat([rows.row_slot_N[keep], torch.zeros(5, dtype=torch.int64)])
    results = _run_both(views_TRL, mix_TSR, row_token_N, row_slot_N)
    _assert_match(results)
    (rows_NL, (_, d_mix_TSR)), _ = results
    assert torch.equal(rows_NL[-5:], torch.zeros(5, LATENT))
    dropped = rows.row_token_N[~keep], rows.row_slot_N[~keep]
    assert torch.equal(d_mix_TSR[dropped], torch.zeros(int((~keep).sum()), 2))


@interpreted_backward
def test_blocks_smaller_than_the_problem():
    from mvmoe_kernels.mix_permute import inverse_rows, mix_permute_backward, mix_permute_forward

    views_TRL, mix_TSR, idx_TS = _case(4, 2, seed=11)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    row_of_TS = inverse_rows(rows.row_token_N, rows.row_slot_N, NUM_TOKENS, 2)
    num_rows = rows.row_token_N.shape[0]
    whole = mix_permute_forward(views_TRL, mix_TSR, row_of_TS, num_rows)
    tiled = mix_permute_forward(views_TRL, mix_TSR, row_of_TS, num_rows, block_t=16, block_l=8)
    assert torch.equal(whole, tiled)
    d_rows_NL = torch.randn(num_rows, LATENT)
    for a, b in zip(mix_permute_backward(views_TRL, mix_TSR, row_of_TS, d_rows_NL),
                    mix_permute_backward(views_TRL, mix_TSR, row_of_TS, d_rows_NL,
                                         block_t=16, block_l=8)):
        torch.testing.assert_close(a, b, **TOL)


def test_reference_is_autograd_exact_on_a_hand_case():
    views_TRL = torch.tensor([[[1.0, 2.0], [3.0, 5.0]]], requires_grad=True)
    mix_TSR = torch.tensor([[[0.5, 0.5]]], requires_grad=True)
    rows_NL = reference_mix_and_permute(views_TRL, mix_TSR, torch.tensor([0]), torch.tensor([0]))
    rows_NL.sum().backward()
    assert rows_NL.tolist() == [[2.0, 3.5]]
    assert mix_TSR.grad.tolist() == [[[3.0, 8.0]]]
    assert views_TRL.grad.tolist() == [[[0.5, 0.5], [0.5, 0.5]]]


@pytest.mark.parametrize("bad,match", [
    (dict(views_TRL=torch.zeros(4, 20)), "views_TRL"),
    (dict(mix_TSR=torch.zeros(4, 2, 3)), "mix_TSR"),
    (dict(row_token_N=torch.zeros(8)), "row_token_N"),
    (dict(row_slot_N=torch.zeros(7, dtype=torch.int64)), "row_slot_N"),
    (dict(row_token_N=torch.full((8,), 4)), "out of range"),
    (dict(row_slot_N=torch.zeros(8, dtype=torch.int64)), "two rows"),
    (dict(row_token_N=torch.tensor([-1, 0, 1, 1, 2, 2, 3, 3])), "padding"),
])
def test_clear_errors(bad, match):
    args = dict(views_TRL=torch.zeros(4, 2, 6), mix_TSR=torch.zeros(4, 2, 2),
                row_token_N=torch.arange(8) // 2, row_slot_N=torch.arange(8) % 2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mix_and_permute(**args, backend="triton")


def test_interpreter_loop_refusal_names_the_versions_and_the_fix():
    why = interpreter_loop_refusal("3.6.0", "2.5.5")
    assert "Triton 3.6.0" in why and "numpy 2.5.5" in why and "Fix:" in why
    assert interpreter_loop_refusal("3.7.1", "2.5.5") is None
    assert interpreter_loop_refusal("3.6.0", "2.4.1") is None


def test_backward_refuses_in_one_line_where_the_interpreter_cannot_loop(monkeypatch):
    monkeypatch.setattr(mix_permute_module, "interpreter_loop_refusal", lambda: "WHY")
    views_TRL, mix_TSR, idx_TS = _case(2, 2)
    rows = expert_major_rows(idx_TS, NUM_EXPERTS)
    views = views_TRL.requires_grad_()
    rows_NL = mix_and_permute(views, mix_TSR, rows.row_token_N, rows.row_slot_N,
                              backend="triton")
    with pytest.raises(ValueError, match="^mix_permute backward: WHY$"):
        rows_NL.sum().backward()
