"""All-to-all dispatch of per-(token, slot) rows: `PerRowAlltoAllTokenDispatcher`.

Legend: T tokens (flattened [S, B] order), E experts, S selected slots per token (top-k),
L latent size, N = T*S permuted rows.

Megatron's alltoall dispatcher replicates each token k times in its permute
(`tokens.index_select(0, sorted_indices)`, expert-major, tokens ascending inside an
expert). Multi-View gives every (token, selected expert) pair its own row, so this
subclass replaces only that gather: row (t, s) sits at index t*S + s of the [T*S, L] row
tensor, and slot s of token t is the s-th True of routing_map row t (the router's
contract: slots ascending by expert id). Everything else is the parent's: the split sizes
and tokens_per_expert (from the routing map alone), the all-to-all, the TP all-gather,
the local sort, the combine and the unpermute (a scatter-add by token id). So the bytes on
the wire equal the latent baseline's exactly.

Capacity / token dropping and drop-and-pad: the router drops the pairs, the layer builds one
row per pair left in the routing map (`dispatch_preprocess_permuted`, MultiViewMoELayer's
`capacity_rows`), and the parent's preprocess / all-to-all / combine run Megatron's
capacity paths unchanged. Refused (ValueError at construction, config/dispatchers.py's
records): padding for quantization, fused permute (TE kernels), shared-expert overlap.

`PerRowDispatch` is the one entry a layer that mixes views dispatches through, whatever
carries the rows (this class, or the dedup dispatcher): the layer calls
`dispatch_preprocess_views` and the dispatcher decides what crosses, so no caller asks
which dispatcher it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Tuple

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_mvmoe.config.dispatchers import DISPATCHERS, check_refusals
from megatron_mvmoe.functional.permute import permute_rows  # noqa: F401 (re-exported)


class PerRowDispatch(ABC):
    """The per-row dispatcher contract: the entry a view-mixing layer dispatches through.

    Notation (as Megatron's token_dispatcher.py):
        T: tokens of this rank (flattened [S, B] order), E: experts, S: selected slots per
        token (top-k), R: views per token (= K, `Variant.views_per_token`), L: row width
        (latent size), N: rows handed to the all-to-all.

    `dispatch_preprocess_views(layer, views_TRL, mix_TSR, topk_idx_TS, routing_map_TE,
    probs_TE, token_shape)` takes every token's R views and each selection's R mixing
    weights (mix_TSR None: one view, every selection sees view 0) and returns what the
    inherited `token_dispatch` sends. An implementation sends one of:
    - "rows": one blended row per (token, expert) (`PerRowAlltoAllTokenDispatcher`: it asks
      the layer for them, `layer.dispatch_rows`, which has the capacity path and the fused
      kernel);
    - "views": the R views and R weights per selection, blended per (token, destination) or
      on arrival (`DedupAlltoAllTokenDispatcher`).
    Construction refuses what config/dispatchers.py's record of the dispatcher refuses.
    """

    multi_view_input: str
    """"rows" or "views": what crosses the wire (reports and tests; the layer never asks)."""

    @abstractmethod
    def dispatch_preprocess_views(self, layer, views_TRL: torch.Tensor, mix_TSR,
                                  topk_idx_TS: torch.Tensor, routing_map_TE: torch.Tensor,
                                  probs_TE: torch.Tensor, token_shape: torch.Size):
        """What `token_dispatch` sends, from the views and mixing weights."""


class PerRowAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher, PerRowDispatch):
    """MoEAlltoAllTokenDispatcher whose permute gathers per-(token, slot) rows."""

    counted_phases = ("dispatch_preprocess_rows", "dispatch_preprocess_permuted")
    """Phase methods of this class the collective counter labels (analysis.a2a.counter);
    the inherited ones are declared by Megatron's class there."""

    multi_view_input = "rows"
    """What MultiViewMoELayer hands this dispatcher: one blended row per (token, expert)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        check_refusals(config, DISPATCHERS["alltoall"])
        super().__init__(num_local_experts, local_expert_indices, config=config,
                         pg_collection=pg_collection)

    def dispatch_preprocess_views(self, layer, views_TRL, mix_TSR, topk_idx_TS,
                                  routing_map_TE, probs_TE, token_shape):
        """Rows: the layer blends one row per (token, expert) and hands them back."""
        return layer.dispatch_rows(views_TRL, mix_TSR, topk_idx_TS, routing_map_TE, probs_TE,
                                   token_shape)

    def dispatch_preprocess_rows(
        self, rows_TSL: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor,
        token_shape: torch.Size,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Like `dispatch_preprocess`, but from rows [T, S, L] instead of tokens [.., L].

        `token_shape` is the shape the combined output takes ([S, B, L] or [T, L]).
        """
        num_tokens, num_slots, latent = rows_TSL.shape
        assert num_slots == self.config.moe_router_topk, "one row per selected slot"
        self._set_routing_state(routing_map_TE, probs_TE, token_shape, latent)
        permuted_NL, permuted_probs_N, self.reversed_local_input_permutation_mapping = (
            permute_rows(rows_TSL, routing_map_TE, probs_TE))
        return permuted_NL, permuted_probs_N

    def dispatch_preprocess_permuted(
        self, permuted_NL: torch.Tensor, row_token_N: torch.Tensor,
        routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, token_shape: torch.Size,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Like `dispatch_preprocess_rows`, for rows the caller already wrote in Megatron's
        permute order (e.g. the fused mix-and-permute kernel); `row_token_N` is each row's
        token, the combine's scatter-add index."""
        assert permuted_NL.shape[0] == row_token_N.shape[0]  # no routing-map sum: no sync
        self._set_routing_state(routing_map_TE, probs_TE, token_shape, permuted_NL.shape[1])
        self.reversed_local_input_permutation_mapping = row_token_N
        permuted_probs_N = probs_TE.T.contiguous().masked_select(routing_map_TE.T.contiguous())
        return permuted_NL, permuted_probs_N

    def _set_routing_state(self, routing_map_TE, probs_TE, token_shape, latent: int) -> None:
        """The metadata the parent's dispatch / combine phases read (split sizes from the
        routing map alone, so both entry points send identical bytes)."""
        num_tokens = routing_map_TE.shape[0]
        assert probs_TE.dim() == 2 and probs_TE.shape[0] == num_tokens
        assert routing_map_TE.dtype == torch.bool
        self.hidden_shape = torch.Size(token_shape)
        self.probs = probs_TE
        self.routing_map = routing_map_TE
        self.tokens_per_expert = self.preprocess(routing_map_TE)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = torch.Size((num_tokens, latent))

