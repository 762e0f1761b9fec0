"""Context parallelism on CPU/gloo (issue 22): the local CP core attention
(layers/cp_attention.py, "all_gather" type) at CP=2 and CP=4 equals full-sequence causal
attention on one rank, rows taken at the positions Megatron's get_batch_on_this_cp_rank
gives each rank (forward and the gradients of queries, keys and values, 1e-6)."""

import pytest
import torch
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_mvmoe.layers.cp_attention import local_positions
from megatron_mvmoe.testing.cp_attention import cp_attention_on_this_rank
from megatron_mvmoe.testing.spawn import run_distributed

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 8, 2, 4, 2, 3


def _global_qkv():
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v


def _naive_attention(q, k, v):
    """Full-sequence causal GQA attention, written out: [s, b, np, hn] -> [s, b, np*hn]."""
    repeat = HEADS // GROUPS
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores_b_n_q_k = torch.einsum("qbnh,kbnh->bnqk", q, k) / HEAD_DIM ** 0.5
    later = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    probs = scores_b_n_q_k.masked_fill(later, float("-inf")).softmax(dim=-1)
    return torch.einsum("bnqk,kbnh->qbnh", probs, v).reshape(SEQ, BATCH, HEADS * HEAD_DIM)


def _output_weights():
    return torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)


def _cp_attention_rank(rank, world_size, sdpa=False):
    attention, pgs = cp_attention_on_this_rank(world_size, HEADS, GROUPS, HEAD_DIM, sdpa)
    # This rank's token positions as Megatron's own load-balanced split gives them.
    split = get_batch_on_this_cp_rank({"positions": torch.arange(SEQ)[None], "cu_seqlens": None},
                                      is_hybrid_cp=False, cp_group=pgs.cp)
    positions = split["positions"][0]
    assert positions.tolist() == local_positions(SEQ, world_size, pgs.cp.rank()).tolist()
    q, k, v = (t[positions].clone().requires_grad_(True) for t in _global_qkv())
    out = attention(q, k, v, None)
    (out * _output_weights()[positions]).sum().backward()
    return {"positions": positions, "out": out.detach(), "q": q.grad, "k": k.grad,
            "v": v.grad}


@pytest.mark.parametrize("cp,sdpa", [(2, False), (4, False), (2, True)],
                         ids=["cp2", "cp4", "cp2_sdpa"])
def test_cp_attention_matches_full_sequence(cp, sdpa):
    """cp2_sdpa: the CP attention on torch SDPA (layers/sdpa_attention.py) gathers and masks
    the same way."""
    q, k, v = (t.clone().requires_grad_(True) for t in _global_qkv())
    out = _naive_attention(q, k, v)
    (out * _output_weights()).sum().backward()
    results = run_distributed(_cp_attention_rank, cp, args=(sdpa,))
    assert sorted(torch.cat([r["positions"] for r in results]).tolist()) == list(range(SEQ))
    k_grad, v_grad = torch.zeros_like(k), torch.zeros_like(v)
    for r in results:
        rows = r["positions"]
        torch.testing.assert_close(r["out"], out.detach()[rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["q"], q.grad[rows], atol=1e-6, rtol=0)
        k_grad[rows], v_grad[rows] = r["k"], r["v"]
    torch.testing.assert_close(k_grad, k.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(v_grad, v.grad, atol=1e-6, rtol=0)


def _refusals_rank(rank, world_size):
    from megatron.core.transformer.enums import AttnMaskType

    attention, _ = cp_attention_on_this_rank(world_size, HEADS, GROUPS, HEAD_DIM)
    q, k, v = (t[: SEQ // world_size] for t in _global_qkv())
    try:
        attention(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_what_the_cp_attention_cannot_do_is_refused_with_the_fix():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mvmoe.layers.cp_attention import CPDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM,
                               num_attention_heads=HEADS, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"cp_comm_type='p2p': .*set --cp-comm-type all_gather"):
        CPDotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type="p2p")
    messages = run_distributed(_refusals_rank, 2)
    assert all("causal only (use --context-parallel-size 1 for other masks)" in m
               for m in messages), messages
