"""Megatron's MoE aux-loss bookkeeping fixes after 0.19.2, through the stock TopKRouter and
our MultiRouter (R = 1 and R = 2), against naive references, on gloo ranks.

- upstream #6114: expert-bias token counts exclude padded tokens (0.19.2 applies the [T]
  mask to the [T, E] map unbroadcast: a shape error when T != E, a wrong mask when T == E).
- upstream #7481: under calculate_per_token_loss the aux loss is pre-multiplied by the LOCAL
  valid-token count (0.19.2 reads it after an in-place TP all-reduce: the group's count).
- upstream #7183: with a padding mask that count is the exact number of valid tokens, for
  aux, seq-aux (a micro-batch total, not floored per sequence) and global aux.
- upstream #7213/#7214: the global aux loss divides the counts it accumulated over
  micro-batches by the tokens they were counted on (0.19.2: ga_steps x the CURRENT
  micro-batch's count), and restarts after reset_global_aux_loss_tracker.

The stock router gets those fixes from the platform layer (megatron_mvmoe/platform/
cpu_patches.py); run with MVMOE_CPU_PATCHES_SKIP naming them to see the stock cases fail on
0.19.2's own code. Gradients are those of the aux losses alone (the main path gets a zero
upstream), compared with autograd through the naive formulas.
"""

import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.testing.spawn import run_distributed

HIDDEN, EXPERTS, TOPK, COEFF = 8, 4, 2, 0.1
ROUTERS = ("stock", "multi_router_r1", "multi_router_r2")


def _config(num_routers=1, **overrides):
    base = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_variant="multi_router", latent_size=8,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=1, gate_scale=1.0),
        moe_router_score_function="sigmoid", moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=COEFF,
        use_cpu_initialization=True, add_bias_linear=False)
    base.update(overrides)
    return MVMoETransformerConfig(**base)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _setup(tp=1):
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout

    destroy_layout()
    return initialize_layout(ParallelLayout(tp=tp))


def _router(kind, config_overrides, pg, seed=0):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_mvmoe.routing import MultiRouter

    num_routers = 2 if kind == "multi_router_r2" else 1
    config = _config(num_routers=num_routers, **config_overrides)
    router = TopKRouter(config, pg) if kind == "stock" else MultiRouter(config, pg)
    with torch.no_grad():
        router.weight.copy_(_randn(*router.weight.shape, seed=seed))
    router.set_layer_number(1)
    router.train()
    return router


def _aux_grad(router, hidden_SBD, padding_SB):
    """Gradient of the router weight from the aux losses only."""
    router.weight.grad = None
    probs_TE, map_TE = router(hidden_SBD, padding_SB)
    (probs_TE * 0).sum().backward()
    return router.weight.grad.clone(), map_TE


def _naive_scores(weight, hidden_TD, num_routers):
    """Summed per-head sigmoid scores normalised over experts (TopKRouter's sigmoid aux
    scores at R = 1)."""
    weight_RED = weight.view(num_routers, EXPERTS, HIDDEN)
    summed_TE = sum(torch.sigmoid(hidden_TD @ weight_RED[r].T) for r in range(num_routers))
    return summed_TE / (summed_TE.sum(-1, keepdim=True) + 1e-20)


def _naive_counts(scores_TE, valid_T):
    """Experts chosen per valid token (top-k of the unbiased aux scores), loop by loop."""
    counts_E = torch.zeros(EXPERTS)
    for t in range(scores_TE.shape[0]):
        if valid_T[t]:
            for e in torch.topk(scores_TE[t].detach(), TOPK).indices.tolist():
                counts_E[e] += 1
    return counts_E


def _assert_close(got, want, where=""):
    """fp32 through different summation orders: 1e-5 of the gradient's scale (the bugs
    change it by factors from 1.4 to 3.3)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()),
                               msg=lambda m: f"{where} {m}")


def _all_sum(value, world_size):
    if world_size == 1:
        return value
    value = value.clone()
    torch.distributed.all_reduce(value)
    return value


# ---------------------------------------------------------------- #6114 expert-bias counts
def _expert_bias_counts_rank(rank, world_size, kind, seq, batch):
    pg = _setup()
    router = _router(kind, dict(moe_router_enable_expert_bias=True,
                                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
                     pg)
    hidden_SBD = _randn(seq, batch, HIDDEN, seed=3)
    padding_SB = torch.zeros(seq, batch, dtype=torch.bool)
    padding_SB[-1, :] = True  # the last position of every sequence is padding
    padding_SB[0, 0] = True
    _, map_TE = router(hidden_SBD, padding_SB)
    valid_T = ~padding_SB.reshape(-1)
    want_E = torch.zeros(EXPERTS)
    for t in range(map_TE.shape[0]):
        if valid_T[t]:
            want_E += map_TE[t].float()
    return router.local_tokens_per_expert.clone(), want_E


@pytest.mark.parametrize("kind", ROUTERS)
@pytest.mark.parametrize("seq,batch", [(4, 2), (2, 2)], ids=["T!=E", "T==E"])
def test_expert_bias_counts_exclude_padding(kind, seq, batch):
    got_E, want_E = run_distributed(_expert_bias_counts_rank, 1, timeout_s=180,
                                    args=(kind, seq, batch))[0]
    assert torch.equal(got_E, want_E)


# --------------------------------------------- #7481 / #7183 per-token-loss pre-multiplier
def _per_token_scale_rank(rank, world_size, kind, aux_type):
    pg = _setup(tp=world_size)
    seq, batch = 4, 2
    hidden_SBD = _randn(seq, batch, HIDDEN, seed=10 + rank)  # SP: each TP rank its tokens
    padding_SB = torch.zeros(seq, batch, dtype=torch.bool)
    # rank 0: 7 valid tokens (3 + 4 per sequence), rank 1: 3 (1 + 2): uneven on purpose
    padded = [(0, 0)] if rank == 0 else [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    for s, b in padded:
        padding_SB[s, b] = True
    valid = int((~padding_SB).sum())
    grads = []
    for per_token in (False, True):
        router = _router(kind, dict(moe_router_load_balancing_type=aux_type,
                                    calculate_per_token_loss=per_token), pg)
        grads.append(_aux_grad(router, hidden_SBD, padding_SB)[0])
        router.reset_global_aux_loss_tracker()
    return grads, valid, world_size


@pytest.mark.parametrize("kind", ROUTERS)
@pytest.mark.parametrize("aux_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_per_token_loss_premultiplies_by_local_valid_tokens_at_tp2(kind, aux_type):
    """grad(per-token) = grad(mean) x local valid tokens x TP size, on each rank."""
    for (mean_grad, per_token_grad), valid, tp in run_distributed(
            _per_token_scale_rank, 2, timeout_s=240, args=(kind, aux_type)):
        _assert_close(per_token_grad, mean_grad * valid * tp)


# ------------------------------------------------------- aux_loss against the formula
def _aux_loss_formula_rank(rank, world_size, kind):
    pg = _setup(tp=world_size)
    seq, batch = 4, 2
    hidden_SBD = _randn(seq, batch, HIDDEN, seed=20 + rank)
    padding_SB = torch.zeros(seq, batch, dtype=torch.bool)
    padding_SB[: 1 + 2 * rank, 1] = True
    router = _router(kind, dict(calculate_per_token_loss=True), pg)
    got, _ = _aux_grad(router, hidden_SBD, padding_SB)
    num_routers = 2 if kind == "multi_router_r2" else 1
    weight = router.weight.detach().clone().requires_grad_(True)
    hidden_TD = hidden_SBD.reshape(-1, HIDDEN)
    valid_T = ~padding_SB.reshape(-1)
    scores_TE = _naive_scores(weight, hidden_TD, num_routers)
    counts_E = _all_sum(_naive_counts(scores_TE, valid_T), world_size)
    tokens = _all_sum(valid_T.sum().float(), world_size)
    probs_E = (scores_TE * valid_T[:, None]).sum(0)
    loss = EXPERTS * COEFF / (TOPK * tokens ** 2) * (probs_E * counts_E).sum()
    loss = loss * valid_T.sum() * world_size  # per-token loss: local valid x TP
    (want,) = torch.autograd.grad(loss, weight)
    return got, want


@pytest.mark.parametrize("kind", ROUTERS)
def test_aux_loss_gradient_matches_the_formula_with_padding_at_tp2(kind):
    for got, want in run_distributed(_aux_loss_formula_rank, 2, timeout_s=240, args=(kind,)):
        _assert_close(got, want)


# ------------------------------------------ #7213 / #7214 global aux over micro-batches
VALID_PER_MICROBATCH = ((8, 8), (5, 3), (2, 6), (7, 1))  # (rank 0, rank 1) valid tokens


def _global_aux_rank(rank, world_size, kind):
    pg = _setup()  # DP = 2: the global counts are reduced over tp x dp x cp = 2 ranks
    seq, batch = 4, 2
    router = _router(kind, dict(moe_router_load_balancing_type="global_aux_loss"), pg)
    num_routers = 2 if kind == "multi_router_r2" else 1
    seen_E, seen_tokens, results = torch.zeros(EXPERTS), 0.0, []
    for step, valid_by_rank in enumerate(VALID_PER_MICROBATCH):
        if step == 3:  # a new global batch: finalize_model_grads resets the tracker
            router.reset_global_aux_loss_tracker()
            seen_E, seen_tokens = torch.zeros(EXPERTS), 0.0
        hidden_SBD = _randn(seq, batch, HIDDEN, seed=100 * step + rank)
        valid_T = torch.arange(seq * batch) < valid_by_rank[rank]
        padding_SB = (~valid_T).reshape(seq, batch)
        got, _ = _aux_grad(router, hidden_SBD, padding_SB)
        weight = router.weight.detach().clone().requires_grad_(True)
        scores_TE = _naive_scores(weight, hidden_SBD.reshape(-1, HIDDEN), num_routers)
        seen_E = seen_E + _all_sum(_naive_counts(scores_TE, valid_T), world_size)
        tokens = float(sum(valid_by_rank))
        seen_tokens += tokens
        probs_E = (scores_TE * valid_T[:, None]).sum(0)
        # f_i over every token counted so far in this global batch, P_i over this one
        loss = EXPERTS * COEFF / TOPK * ((probs_E / tokens) * (seen_E / seen_tokens)).sum()
        (want,) = torch.autograd.grad(loss, weight)
        results.append((got, want))
    return results


@pytest.mark.parametrize("kind", ROUTERS)
def test_global_aux_loss_normalises_by_the_tokens_it_counted(kind):
    for rank_results in run_distributed(_global_aux_rank, 2, timeout_s=240, args=(kind,)):
        for step, (got, want) in enumerate(rank_results):
            _assert_close(got, want, f"micro-batch {step}")
