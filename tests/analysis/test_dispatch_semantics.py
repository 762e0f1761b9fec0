"""Analytic dispatch semantics, placement, routing models and link time, each against a
naive per-token loop."""

from collections import defaultdict

import pytest
import torch

from megatron_mvmoe.a2a_model.semantics import (KINDS, SEMANTICS, PayloadShape,
                                                        link_bytes, sent_by_link)
from megatron_mvmoe.analysis.a2a.link_time import LinkSpec, layer_a2a_time_s, rank_times_s
from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.analysis.routing.rank_load import rank_loads, routing_maps


def _naive(maps, pl, shape, semantics):
    """Per-token loop: bytes[(phase, payload)][(src, dst)] of the forward."""
    W, K, b, pb, wb = shape.width, shape.views, shape.dtype_bytes, shape.probs_bytes, \
        shape.weight_bytes
    out = defaultdict(lambda: defaultdict(int))

    def pair(n, may_use_views=True):  # (row bytes, prob+weight bytes, used views)
        if shape.kind == "token":
            return W * b, n * pb, False
        if shape.kind == "naive_multi_view":
            return K * W * b, n * pb + n * K * wb, True
        blend, views = n * W * b, K * W * b + n * K * wb
        if may_use_views and views < blend:
            return K * W * b, n * pb + n * K * wb, True
        return blend, n * pb, False

    for s in range(pl.ep):
        for t in range(maps.shape[1]):
            experts = maps[s, t].nonzero().flatten().tolist()
            by_rank = defaultdict(list)
            for e in experts:
                by_rank[pl.rank_of_expert(e)].append(e)
            if semantics == "row":
                for e in experts:
                    q = pl.rank_of_expert(e)
                    k = K if shape.kind == "naive_multi_view" else 1
                    out["d_tok"][(s, q)] += k * W * b
                    out["d_prob"][(s, q)] += pb + (K * wb if shape.kind == "naive_multi_view"
                                                   else 0)
                    out["c_tok"][(q, s)] += W * b
            elif semantics == "rank":
                for q, es in by_rank.items():
                    rows, probs, _ = pair(len(es))
                    out["d_tok"][(s, q)] += rows
                    out["d_prob"][(s, q)] += probs
                    out["c_tok"][(q, s)] += W * b
            else:
                by_node = defaultdict(list)
                for q in by_rank:
                    by_node[pl.node_of(q)].append(q)
                for node, qs in by_node.items():
                    p = node * pl.ranks_per_node + s % pl.ranks_per_node
                    rows, probs, used_views = pair(sum(len(by_rank[q]) for q in qs))
                    out["d_tok"][(s, p)] += rows
                    out["d_prob"][(s, p)] += probs
                    out["c_tok"][(p, s)] += W * b
                    for q in qs:
                        rows, probs, _ = pair(len(by_rank[q]), used_views)
                        out["d_tok"][(p, q)] += rows
                        out["d_prob"][(p, q)] += probs
                        out["c_tok"][(q, p)] += W * b
    return out


def _dense(sparse, ranks):
    m = torch.zeros(ranks, ranks, dtype=torch.long)
    for (s, q), v in sparse.items():
        m[s, q] += v
    return m


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ep,per_node,topk", [(4, 2, 3), (8, 4, 6), (2, 2, 2)])
def test_link_bytes_match_naive_loop(semantics, kind, ep, per_node, topk):
    experts = 16
    pl = EpPlacement(ep, per_node, experts)
    maps = routing_maps("skewed", ep, 24, experts, topk, load=1.2, seed=ep + topk)
    # small width so both Multi-View choices occur (views win from n = 3 at W = 8, K = 2)
    shape = PayloadShape(width=8, kind=kind, views=2, dtype_bytes=2)
    got = link_bytes(maps, pl, shape, semantics)
    ref = _naive(maps, pl, shape, semantics)
    assert torch.equal(got[("token_dispatch", "fwd", "tokens")], _dense(ref["d_tok"], ep))
    assert torch.equal(got[("token_dispatch", "fwd", "probs")], _dense(ref["d_prob"], ep))
    assert torch.equal(got[("token_combine", "fwd", "tokens")], _dense(ref["c_tok"], ep))
    assert torch.equal(got[("token_dispatch", "bwd", "tokens")],
                       _dense(ref["d_tok"], ep).T)


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("kind", KINDS)
def test_histogram_gives_the_per_token_bytes(semantics, kind):
    """The live metrics' histogram path (one rank's H[q, a, c]) equals link_bytes's
    per-token path for that rank's tokens, bookkeeping included."""
    from megatron_mvmoe.a2a_model.semantics import (LinkMatrices, add_source_bytes,
                                                       add_source_histogram,
                                                       destination_histogram, experts_per_dest)

    pl, topk = EpPlacement(8, 4, 16), 6
    maps = routing_maps("skewed", 8, 24, 16, topk, load=1.2, seed=5)
    shape = PayloadShape(width=8, kind=kind, views=2, dtype_bytes=2)
    for source in (0, 5):
        n_TQ = experts_per_dest(maps[source], pl)
        per_token, histogram = LinkMatrices(8), LinkMatrices(8)
        add_source_bytes(per_token, n_TQ, source, pl, shape, semantics)
        add_source_histogram(histogram, destination_histogram(n_TQ, 4, topk), source, pl,
                             shape, semantics)
        assert per_token.m.keys() == histogram.m.keys()
        for key, matrix in per_token.m.items():
            assert torch.equal(histogram.m[key], matrix), (source, key)


def test_dedup_never_costs_more_than_rows_and_multi_view_chooses():
    pl = EpPlacement(8, 4, 32)
    maps = routing_maps("balanced", 8, 64, 32, 8, seed=3)
    for kind in ("token", "multi_view"):
        shape = PayloadShape(width=16, kind=kind, views=2)
        rows = link_bytes(maps, pl, shape, "row")[("token_dispatch", "fwd", "tokens")].sum()
        rank = link_bytes(maps, pl, shape, "rank")[("token_dispatch", "fwd", "tokens")].sum()
        assert rank <= rows
    base = link_bytes(maps, pl, PayloadShape(16), "rank")[("token_dispatch", "fwd", "tokens")]
    mv = link_bytes(maps, pl, PayloadShape(16, "multi_view", 2), "rank")[
        ("token_dispatch", "fwd", "tokens")]
    naive = link_bytes(maps, pl, PayloadShape(16, "naive_multi_view", 2), "rank")[
        ("token_dispatch", "fwd", "tokens")]
    assert base.sum() < mv.sum() <= naive.sum()  # blends cannot be deduplicated for free


def test_row_semantic_is_topk_rows_per_token():
    pl = EpPlacement(4, 2, 8)
    maps = routing_maps("balanced", 4, 10, 8, 3, seed=1)
    m = link_bytes(maps, pl, PayloadShape(4, dtype_bytes=4), "row")
    assert m[("token_dispatch", "fwd", "tokens")].sum(1).tolist() == [10 * 3 * 16] * 4


def test_placement_links_and_errors():
    pl = EpPlacement.for_layout(ep=16, etp=2, gpus_per_node=8, num_experts=160)
    assert (pl.ranks_per_node, pl.nodes) == (4, 4)
    assert [pl.link(5, q) for q in (5, 6, 9)] == ["self", "intra", "inter"]
    assert pl.proxy(source=5, node=2) == 9
    assert EpPlacement.for_layout(8, 1, 8, 160).nodes == 1
    with pytest.raises(ValueError, match="ranks_per_node"):
        EpPlacement(6, 4, 24)
    with pytest.raises(ValueError, match="ep"):
        EpPlacement(4, 2, 10)
    matrix = torch.arange(16).view(4, 4)
    split = sent_by_link(matrix, EpPlacement(4, 2, 8))
    assert split["self"].tolist() == [0, 5, 10, 15]
    assert split["intra"].tolist() == [1, 4, 11, 14]
    assert (split["self"] + split["intra"] + split["inter"]).tolist() == matrix.sum(1).tolist()


def test_routing_models():
    balanced = routing_maps("balanced", 4, 500, 16, 4, seed=0)
    assert balanced.sum(-1).eq(4).all()
    flat = rank_loads(balanced, 4).double()
    skew = rank_loads(routing_maps("skewed", 4, 500, 16, 4, load=1.5, seed=0), 4).double()
    assert skew.max() / skew.mean() > flat.max() / flat.mean()
    prof = routing_maps("profile", 2, 300, 8, 2, shares=[0.7, 0.1, 0.1, 0.1], seed=0)
    assert prof.sum(-1).eq(2).all()
    with pytest.raises(ValueError, match="routing"):
        routing_maps("zipf", 2, 3, 8, 2)
    with pytest.raises(ValueError, match="shares"):
        routing_maps("profile", 2, 3, 8, 2)


def test_link_time_by_hand():
    pl = EpPlacement(4, 2, 8)
    links = LinkSpec(nvlink_GBps=100.0, network_GBps=10.0)
    m = torch.zeros(4, 4, dtype=torch.long)
    m[0, 1] = 200e9  # intra: 2 s
    m[0, 2] = 10e9   # inter: 1 s
    m[3, 3] = 10**15  # self: free
    m[3, 0] = 30e9   # inter into rank 0: rank 0 receives 30e9 > sends 10e9 -> 3 s
    times = rank_times_s(m, pl, links)
    assert times.tolist() == pytest.approx([2 + 3, 2, 1, 3])
    layer = layer_a2a_time_s({("token_dispatch", "fwd", "tokens"): m}, pl, links)
    assert layer["token_dispatch/fwd"] == pytest.approx(5.0)
    assert layer["total"] == pytest.approx(5.0)


def test_load_profile_and_tiny_rows():
    from megatron_mvmoe.analysis.a2a.scale import tiny_real_routing_rows
    from megatron_mvmoe.analysis.routing.checkpoint_routing import load_profile

    map_a = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)  # loads 2, 1, 1, 0
    map_b = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)  # loads 0, 0, 2, 2
    assert load_profile({"1": map_a, "2": map_b}) == pytest.approx([0.5, 0.375, 0.125, 0.0])
    maps = routing_maps("balanced", 1, 64, 8, 3, seed=2)[0]
    rows = tiny_real_routing_rows({"1": maps}, hidden=16, latent=8, views=2, eps=(2,))
    assert [r["semantics"] for r in rows] == list(SEMANTICS)
    assert rows[0]["ratio"] == 1.0 and all(r["ratio"] >= 1.0 for r in rows)
