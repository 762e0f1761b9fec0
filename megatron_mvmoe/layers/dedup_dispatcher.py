"""Deduplicating all-to-all dispatch on Megatron's alltoall dispatcher:
`DedupAlltoAllTokenDispatcher` (one copy per (token, destination rank), DeepEP-style, or per
(token, destination node) forwarded inside the node, HybridEP-style), with Multi-View's
choice per (token, destination) between n blended rows and the K views + n x K weights.

Legend: T tokens, E experts, El local experts, P EP ranks, G EP ranks per node, K views,
I items (what one rank holds at a hop: tokens at the source, received pairs after),
J selections (item, expert) of those items, W row width.

An item is sent in one of three modes (`SHARED`, `VIEWS`, `BLEND`):
- SHARED: one row shared by all its experts (baseline, Multi-Router, SMoE; Multi-View with
  a single view).
- VIEWS: the K view rows; each selection carries its K mixing weights and the receiver
  blends (v_0 + sum_m a_m (v_m - v_0), the layer's `expert_rows`).
- BLEND: one blended row per selection.
A hop groups selections by (item, destination) into pairs; a VIEWS item becomes BLEND for a
pair where n blends are not larger than K views + n*K weights (`views_are_cheaper`), a BLEND
item can only forward its blends. The "rank" semantic is one hop to the expert's rank; the
"node" semantic is hop 1 to the expert node's proxy (rank node*G + own index in the node)
and hop 2 to the expert's rank. The receiver of the last hop runs its experts on every
selection (expert-major, as Megatron's permute) and sums each pair's gated outputs; the
combine reverses every hop, summing per pair, so it sends one row per pair.

Collectives per hop (all over the EP group, counted at torch.distributed): the split
counts (int64, metadata), the rows (tokens), the probs followed by the mixing weights
(floats), the expert ids and per-pair (n, mode) (int64, metadata). Floats go through
Megatron's autograd `all_to_all`, so the backward sends their gradients back.

Refused (ValueError at construction, config/dispatchers.py's dedup records): TP / ETP > 1,
capacity / drop-and-pad, padding for quantization, fused permute, shared-expert overlap (as
`PerRowAlltoAllTokenDispatcher`), and a node size that does not divide EP. It implements the
per-row contract (`PerRowDispatch`, "views"); the views per token come from the variant's
record (`Variant.views_per_token`), so any variant that mixes views sends views.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_mvmoe.config.dispatchers import DISPATCHERS, check_refusals
from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.functional.mixing import blend_views, views_are_cheaper
from megatron_mvmoe.layers.per_row_dispatcher import PerRowDispatch

SHARED, VIEWS, BLEND = 0, 1, 2
DEDUP_SEMANTICS = ("rank", "node")


@dataclass
class _Items:
    rows_XW: torch.Tensor
    """Payload rows of every item, item after item."""
    start_I: torch.Tensor
    """First row of each item."""
    mode_I: torch.Tensor
    """SHARED / VIEWS / BLEND."""
    sel_item_J: torch.Tensor
    """Item of each selection (ascending; experts ascending inside an item)."""
    sel_expert_J: torch.Tensor
    """Global expert id of each selection."""
    sel_prob_J: torch.Tensor
    """Routing probability of each selection (differentiable)."""
    sel_weight_JK: Optional[torch.Tensor]
    """Mixing weights of each selection (used where its item is VIEWS), None without views."""


@dataclass
class _Hop:
    """What the combine needs to send a hop's pair outputs back."""

    pair_item: torch.Tensor
    """Sender side: the item of each sent pair, in send order."""
    sent_pairs: List[int]
    received_pairs: List[int]
    num_items: int


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def blend(views_NKL: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """v_0 + sum_m a_m (v_m - v_0) for N rows (functional.mixing.blend_views, one slot each): the
    same arithmetic as the Multi-View layer's `expert_rows`."""
    return blend_views(views_NKL, weights_NK.unsqueeze(1))[:, 0]


def selection_rows(items: _Items, num_views: int) -> torch.Tensor:
    """[J, W]: the row the expert of each selection sees."""
    first_J = _exclusive_cumsum(torch.bincount(items.sel_item_J, minlength=len(items.mode_I)))
    position_J = torch.arange(len(items.sel_item_J)) - first_J[items.sel_item_J]
    start_J, mode_J = items.start_I[items.sel_item_J], items.mode_I[items.sel_item_J]
    rows_JW = items.rows_XW.index_select(0, torch.where(mode_J == BLEND, start_J + position_J,
                                                        start_J))
    views_J = (mode_J == VIEWS).nonzero().flatten()
    if views_J.numel():
        view_rows_VK = start_J[views_J].unsqueeze(1) + torch.arange(num_views)
        blended = blend(items.rows_XW[view_rows_VK], items.sel_weight_JK[views_J])
        rows_JW = rows_JW.index_copy(0, views_J, blended.to(rows_JW.dtype))
    return rows_JW


class DedupAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher, PerRowDispatch):
    """One copy per (token, destination rank or node); Multi-View sends views or blends."""

    counted_phases = ("dispatch_preprocess", "dispatch_preprocess_views", "token_dispatch",
                      "dispatch_postprocess", "combine_preprocess", "token_combine")
    """Phase methods the collective counter labels (analysis.a2a.counter)."""

    multi_view_input = "views"
    """A view-mixing layer hands this dispatcher the K views + mixing weights
    (`dispatch_preprocess_views`), blended per (token, destination) or on arrival."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None,
                 semantics: str = "rank", ranks_per_node: Optional[int] = None) -> None:
        assert semantics in DEDUP_SEMANTICS, f"the registry builds {DEDUP_SEMANTICS} only"
        check_refusals(config, DISPATCHERS[f"dedup_{semantics}"])
        super().__init__(num_local_experts, local_expert_indices, config=config,
                         pg_collection=pg_collection)
        self.semantics = semantics
        self.ranks_per_node = ranks_per_node or self.ep_size
        assert self.ep_size % self.ranks_per_node == 0, (
            f"ranks_per_node {self.ranks_per_node} does not divide EP {self.ep_size} (the "
            "config refuses moe_dispatch_ranks_per_node)")
        self.num_views = get_variant(getattr(config, "moe_variant", "smoe")).views_per_token(
            config)
        self._source: Optional[_Items] = None
        self._hops: List[_Hop] = []
        self._final: Optional[_Items] = None
        self._expert_order: Optional[torch.Tensor] = None

    # ---- source side --------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """One SHARED item per token."""
        rows_TW = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self._start(rows_TW, torch.arange(rows_TW.shape[0]), SHARED, None,
                           routing_map, probs, hidden_states.shape)

    def dispatch_preprocess_views(self, layer, views_TRL, mix_TSR, topk_idx_TS, routing_map,
                                  probs, token_shape):
        """One VIEWS item per token (K view rows, K weights per selection); one view: SHARED
        (the slots are the routing map's: `topk_idx_TS` is not needed)."""
        num_tokens, num_views, latent = views_TRL.shape
        if mix_TSR is None or num_views == 1:
            return self._start(views_TRL[:, 0], torch.arange(num_tokens), SHARED, None,
                               routing_map, probs, token_shape)
        assert num_views == self.num_views, "views per token = config.multi_view.num_views"
        weights_JK = mix_TSR.reshape(-1, num_views)
        return self._start(views_TRL.reshape(-1, latent), torch.arange(num_tokens) * num_views,
                           VIEWS, weights_JK, routing_map, probs, token_shape)

    def _start(self, rows_XW, start_T, mode, weights_JK, routing_map, probs, token_shape):
        assert routing_map.dtype == torch.bool and probs.shape == routing_map.shape
        self.hidden_shape = torch.Size((*token_shape[:-1], rows_XW.shape[-1]))
        self.routing_map, self.probs = routing_map, probs
        token_J, expert_J = routing_map.nonzero(as_tuple=True)
        if weights_JK is not None:
            assert weights_JK.shape[0] == token_J.numel(), "one weight row per selection"
        self._source = _Items(rows_XW, start_T, torch.full_like(start_T, mode), token_J,
                              expert_J, probs[routing_map], weights_JK)
        return rows_XW, self._pack_floats(self._source)

    def _pack_floats(self, items: _Items) -> torch.Tensor:
        if self.num_views == 1 or items.sel_weight_JK is None:
            return items.sel_prob_J
        return torch.cat([items.sel_prob_J, items.sel_weight_JK.reshape(-1).to(
            items.sel_prob_J.dtype)])

    def _unpack_floats(self, items: _Items, rows_XW, floats_F) -> _Items:
        """The items with the (counter-marked) tensors the phase received."""
        num_sel = items.sel_item_J.numel()
        weights = (floats_F[num_sel:].view(num_sel, self.num_views)
                   if items.sel_weight_JK is not None and self.num_views > 1 else None)
        return replace(items, rows_XW=rows_XW, sel_prob_J=floats_F[:num_sel],
                       sel_weight_JK=weights)

    # ---- hops ---------------------------------------------------------------------------
    def token_dispatch(self, rows_XW, floats_F):
        items = self._unpack_floats(self._source, rows_XW, floats_F)
        experts_per_rank = self.num_experts // self.ep_size
        self._hops = []
        if self.semantics == "node":
            per_node = self.ranks_per_node
            node_J = items.sel_expert_J // experts_per_rank // per_node
            items = self._hop(items, node_J * per_node + self.ep_rank % per_node)
        items = self._hop(items, items.sel_expert_J // experts_per_rank)
        self._final = items
        return items.rows_XW, self._pack_floats(items)

    def _hop(self, items: _Items, dest_J: torch.Tensor) -> _Items:
        """Send every (item, destination) pair once; returns the receiver's items."""
        num_items, ranks = len(items.mode_I), self.ep_size
        order_J = torch.sort(dest_J, stable=True).indices
        key, sel_pair, n_pair = torch.unique_consecutive(
            dest_J[order_J] * num_items + items.sel_item_J[order_J], return_inverse=True,
            return_counts=True)
        pair_dest, pair_item = key // num_items, key % num_items
        mode = items.mode_I[pair_item]
        keep_views = torch.as_tensor(views_are_cheaper(
            n_pair, self.num_views, items.rows_XW.shape[-1], items.rows_XW.element_size(),
            items.sel_prob_J.element_size()))
        mode = torch.where((mode == VIEWS) & ~keep_views, BLEND, mode)
        count = torch.where(mode == SHARED, 1, torch.where(mode == VIEWS, self.num_views, n_pair))
        rows = self._pair_rows(items, order_J, pair_item, mode, count, n_pair)
        sel_views = mode[sel_pair] == VIEWS
        send = torch.stack([torch.bincount(pair_dest, weights=count, minlength=ranks).long(),
                            torch.bincount(pair_dest, minlength=ranks),
                            torch.bincount(dest_J, minlength=ranks),
                            torch.bincount(pair_dest[sel_pair[sel_views]], minlength=ranks)], 1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        s_rows, s_pairs, s_sel, s_views = (send[:, i].tolist() for i in range(4))
        r_rows, r_pairs, r_sel, r_views = (recv[:, i].tolist() for i in range(4))
        out_rows = all_to_all(self.ep_group, rows, r_rows, s_rows)
        out_prob = all_to_all(self.ep_group, items.sel_prob_J[order_J], r_sel, s_sel)
        out_expert = self._send_ints(items.sel_expert_J[order_J], r_sel, s_sel)
        out_info = self._send_ints(torch.stack([n_pair, mode], 1), r_pairs, s_pairs)
        weights = None
        if items.sel_weight_JK is not None:
            k = self.num_views
            sent_w = items.sel_weight_JK[order_J[sel_views]].reshape(-1)
            got_w = all_to_all(self.ep_group, sent_w, [v * k for v in r_views],
                               [v * k for v in s_views])
            weights = self._received_weights(out_info, got_w)
        self._hops.append(_Hop(pair_item, s_pairs, r_pairs, num_items))
        return self._received_items(out_rows, out_info, out_expert, out_prob, weights)

    def _pair_rows(self, items, order_J, pair_item, mode, count, n_pair) -> torch.Tensor:
        """The rows of every pair in send order (SHARED/VIEWS: the item's rows, BLEND: the
        blend of each of its selections)."""
        pair_of_row = torch.repeat_interleave(torch.arange(len(count)), count)
        within = torch.arange(int(count.sum())) - _exclusive_cumsum(count)[pair_of_row]
        item_rows = items.start_I[pair_item][pair_of_row] + within
        if not bool((mode == BLEND).any()):
            return items.rows_XW.index_select(0, item_rows)
        bank = torch.cat([items.rows_XW, selection_rows(items, self.num_views)])
        first_sel = _exclusive_cumsum(n_pair)
        blend_rows = items.rows_XW.shape[0] + order_J[
            (first_sel[pair_of_row] + within).clamp(max=len(order_J) - 1)]
        return bank.index_select(0, torch.where(mode[pair_of_row] == BLEND, blend_rows,
                                                item_rows))

    def _send_ints(self, values: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        out = values.new_empty((sum(output_splits), *values.shape[1:]))
        dist.all_to_all_single(out, values.contiguous(), output_splits, input_splits,
                               group=self.ep_group)
        return out

    def _received_weights(self, info, got_w) -> torch.Tensor:
        sel_item = torch.repeat_interleave(torch.arange(info.shape[0]), info[:, 0])
        views_sel = (info[sel_item, 1] == VIEWS).nonzero().flatten()
        dense = got_w.new_zeros(len(sel_item), self.num_views)
        return dense.index_copy(0, views_sel, got_w.view(-1, self.num_views))

    def _received_items(self, rows, info, experts, probs, weights) -> _Items:
        n, mode = info[:, 0], info[:, 1]
        count = torch.where(mode == SHARED, 1, torch.where(mode == VIEWS, self.num_views, n))
        sel_item = torch.repeat_interleave(torch.arange(len(n)), n)
        return _Items(rows, _exclusive_cumsum(count), mode, sel_item, experts, probs, weights)

    # ---- experts ------------------------------------------------------------------------
    def dispatch_postprocess(self, rows_XW, floats_F):
        """Every selection's row, expert-major (items ascending), for the local experts."""
        items = self._unpack_floats(self._final, rows_XW, floats_F)
        self._final = items
        local_J = items.sel_expert_J - self.local_expert_indices[0]
        self._expert_order = torch.sort(local_J, stable=True).indices
        rows_JW = selection_rows(items, self.num_views).index_select(0, self._expert_order)
        tokens_per_expert = torch.bincount(local_J, minlength=self.num_local_experts)
        return rows_JW, tokens_per_expert, items.sel_prob_J.index_select(0, self._expert_order)

    def combine_preprocess(self, expert_out_JW):
        """Sum the gated expert outputs of each received pair: one row per pair."""
        items = self._final
        per_sel = torch.zeros_like(expert_out_JW).index_copy(0, self._expert_order,
                                                             expert_out_JW)
        out = expert_out_JW.new_zeros(len(items.mode_I), expert_out_JW.shape[-1])
        return out.index_add(0, items.sel_item_J, per_sel)

    def token_combine(self, pair_out_IW):
        """Reverse every hop, summing the pairs of each item, back to the tokens."""
        out = pair_out_IW
        for hop in reversed(self._hops):
            back = all_to_all(self.ep_group, out, hop.sent_pairs, hop.received_pairs)
            out = back.new_zeros(hop.num_items, back.shape[-1]).index_add(0, hop.pair_item, back)
        return out

    def combine_postprocess(self, tokens_TW):
        self._source = self._final = self._expert_order = None
        self._hops = []
        return tokens_TW.view(self.hidden_shape)

