"""The Multi-Router's auxiliary losses (Megatron 0.19.2's family: aux_loss, seq_aux_loss,
global_aux_loss, z-loss), as a mixin of `routing.router.MultiRouter`: the coefficients,
per-token-loss scaling (x local tokens x TP*CP size), MTP scaling and `MoEMetricsTracker`
logging of TopKRouter, computed on what this router scores (see router.py's docstring for
the rule). The mixin reads the router's config, groups (`tp_cp_group`, `tp_dp_cp_group`),
top-k, expert count and global-aux buffers; the loss math itself is routing/balancing.py."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_mvmoe.functional import sigmoid_scores, sum_over_routers
from megatron_mvmoe.routing.balancing import (
    load_balancing_loss,
    normalized_summed_scores,
    sequence_load_balancing_loss,
    z_loss,
)

AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
_LOG_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


class RouterAuxLosses:
    """Attach the configured auxiliary losses to the router's outputs and log them."""

    def aux_loss_coeff(self, aux_type: str) -> float:
        """Megatron's mapping of moe_router_load_balancing_type to moe_aux_loss_coeff."""
        types = self.config.moe_router_load_balancing_type
        coeffs = self.config.moe_aux_loss_coeff
        if isinstance(types, str):
            return float(coeffs) if types == aux_type else 0.0
        return float(coeffs[types.index(aux_type)]) if aux_type in types else 0.0

    def reset_global_aux_loss_tracker(self) -> None:
        """Called by finalize_model_grads once per global batch."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()
            self.global_aux_tokens_seen.zero_()

    def _losses_active(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _attach_z_loss(self, logits_TRE, valid_T):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self._losses_active():
            return logits_TRE, None
        coeff = coeff / _group_size(self.tp_cp_group)  # as Megatron: grads are summed over TP x CP
        loss = z_loss(logits_TRE, coeff, valid_T)
        num_tokens = logits_TRE.shape[0] if valid_T is None else valid_T.sum()
        logits_TRE = self._attach(logits_TRE, loss, num_tokens)
        loss = self._per_mtp_repeat(loss)
        get_moe_metrics_tracker().record("z_loss", loss / coeff, self._log_layer_number(),
                                         self._num_layers(), avg_group=self.tp_dp_cp_group)
        return logits_TRE, loss.detach()

    @staticmethod
    def _aux_loss_scores(logits_TRE, summed_TE):
        """Summed head scores for the aux losses, sigmoid in fp32 whatever the router dtype
        (Megatron 0.19.2 scores its aux loss in fp32)."""
        if logits_TRE.dtype == torch.float32:
            return summed_TE
        return sum_over_routers(sigmoid_scores(logits_TRE.float()))

    def _attach_aux_losses(self, gates_TS, summed_TE, valid_T, seq_length, batch_size):
        if not self._losses_active() or not any(
                self.aux_loss_coeff(t) > 0 for t in AUX_TYPES):
            return gates_TS, None
        probs_TE = normalized_summed_scores(summed_TE)
        # Megatron's aux-loss map: top-k of the unbiased scores, not the dispatched selection
        aux_idx_TS = torch.topk(probs_TE, k=self.topk, dim=1).indices
        map_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter(1, aux_idx_TS, True)
        if valid_T is not None:
            probs_TE = probs_TE * valid_T.unsqueeze(-1)
            map_TE = map_TE & valid_T.unsqueeze(-1)
        total = None
        for aux_type, loss_fn in (("aux_loss", self._switch_loss),
                                  ("seq_aux_loss", self._seq_loss),
                                  ("global_aux_loss", self._global_loss)):
            coeff = self.aux_loss_coeff(aux_type)
            if coeff <= 0:
                continue
            loss, group, has_dp, num_local = loss_fn(probs_TE, map_TE, coeff, valid_T is not None,
                                                     seq_length, batch_size)
            loss = self._per_mtp_repeat(loss)
            gates_TS = self._attach(gates_TS, loss, num_local)
            get_moe_metrics_tracker().record(
                _LOG_NAMES[aux_type], loss / coeff, self._log_layer_number(),
                self._num_layers(), reduce_group=group, needs_dp_avg=not has_dp)
            total = loss.detach() if total is None else total + loss.detach()
        return gates_TS, total

    def _switch_loss(self, probs_TE, map_TE, coeff, padded, seq_length, batch_size):
        counts_E, local, total = _token_counts(map_TE, self.tp_cp_group, self.topk, padded)
        loss = load_balancing_loss(probs_TE, counts_E, total, self.topk, coeff)
        return loss, self.tp_cp_group, False, local

    def _seq_loss(self, probs_TE, map_TE, coeff, padded, seq_length, batch_size):
        map_SX = map_TE.reshape(seq_length, -1)  # X = B*E: per-sequence expert counts
        counts_X, local, total = _token_counts(map_SX, self.tp_cp_group,
                                               self.topk * batch_size, padded)
        counts_BE = counts_X.view(batch_size, self.num_experts)
        loss = sequence_load_balancing_loss(probs_TE, counts_BE, total, batch_size, self.topk,
                                            coeff)
        # `local` counts tokens per sequence (B folded into the columns): x B is the
        # micro-batch's, which per-token-loss scaling needs (Megatron 0.19.2's fix)
        return loss, self.tp_cp_group, False, local * batch_size

    def _global_loss(self, probs_TE, map_TE, coeff, padded, seq_length, batch_size):
        counts_E, local, total = _token_counts(map_TE, self.tp_dp_cp_group, self.topk, padded)
        self.global_tokens_per_expert += counts_E
        self.ga_steps += 1
        self.global_aux_tokens_seen += total
        # f_i over every token counted in this global batch (upstream #7213/#7214; 0.19.2
        # divides by ga_steps x this micro-batch's tokens): the loss divides by `total`
        scaled_E = self.global_tokens_per_expert * (total / self.global_aux_tokens_seen)
        loss = load_balancing_loss(probs_TE, scaled_E, total, self.topk, coeff)
        return loss, self.tp_dp_cp_group, True, local

    def _attach(self, activation, loss, num_local_tokens):
        """MoEAuxLossAutoScaler. Under calculate_per_token_loss every gradient is later divided
        by the global token count = micro-batches x DP x (local tokens x TP*CP size) (the
        router sees its SP shard), so the loss is pre-multiplied by the last factor, leaving
        the 1 / (micro-batches x DP) scaling of the mean-loss path (Megatron 0.19.2)."""
        if self.config.calculate_per_token_loss:
            loss = loss * num_local_tokens * _group_size(self.tp_cp_group)
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def _per_mtp_repeat(self, loss):
        """A repeated MTP layer runs mtp_num_layers times: count its losses once in total."""
        config = self.config
        if self.is_mtp_layer and config.mtp_use_repeated_layer and config.mtp_num_layers:
            return loss / config.mtp_num_layers
        return loss

    def _log_layer_number(self) -> Optional[int]:
        """Megatron's logging slot: MTP layers come after the decoder layers."""
        if self.layer_number is None or not self.is_mtp_layer:
            return self.layer_number
        return self.layer_number + self.config.num_layers

    def _num_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def _token_counts(map_TX, group, topk: int, padded: bool):
    """Counts per column reduced over `group`, local and total token counts (Megatron's
    get_tokens_per_expert_and_token_count, without its autograd reduce)."""
    counts_X = map_TX.sum(dim=0).float()
    if _group_size(group) > 1:
        torch.distributed.all_reduce(counts_X, group=group)
    if padded:
        local = map_TX.sum() / topk
        return counts_X, local, counts_X.sum() / topk
    local = map_TX.shape[0]
    return counts_X, local, local * _group_size(group)
