"""Megatron-LM fixes made after 0.19.2 to bugs the stock TopKRouter has on EVERY platform
(aux-loss bookkeeping), applied with CUDA too (registered in cpu_patches.UPSTREAM_FIXES);
each Patch names its upstream PR and has a probe that fails once the installed Megatron
carries the fix. Our MultiRouter carries the same fixes in its own code (routing/router.py).
"""

from __future__ import annotations

import functools
import importlib

import torch

from megatron_mvmoe.platform.patch import Patch, rebind

_ROUTER = "megatron.core.transformer.moe.router"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _raw(fn):
    """The Python function under a torch.compile (jit_fuser) wrapper."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _expert_bias_counts_broadcast_padding() -> None:
    """Upstream #6114: `_apply_expert_bias` masks the [T, E] routing map with the flattened
    [T] padding mask unbroadcast: a shape error when T != E and, when T == E, padding
    removed per expert column instead of per token. Mask per token."""
    cls = importlib.import_module(_ROUTER).TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask).unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._mvmoe_wrapped = True
    cls._apply_expert_bias = _apply_expert_bias


def _expert_bias_counts_break() -> bool:
    from types import SimpleNamespace

    fn = _raw(importlib.import_module(_ROUTER).TopKRouter._apply_expert_bias)
    counts = torch.zeros(2)
    owner = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=counts)
    routing_map = torch.tensor([[True, False], [True, True], [False, True]])
    try:
        with torch.enable_grad():
            fn(owner, routing_map, torch.tensor([False, True, False]))
    except RuntimeError:
        return True
    return counts.tolist() != [1.0, 1.0]


def _local_token_count_before_reduce() -> None:
    """Upstream #7481: with a padding mask, `get_tokens_per_expert_and_token_count` reads
    `local_num_tokens` from the per-expert counts AFTER handing them to an in-place TP
    all-reduce, so it returns the group's count: under calculate_per_token_loss the aux
    loss is pre-multiplied by the group's valid tokens instead of this rank's. The local
    count comes from the local routing map instead (same value as 0.19.2 at group size 1)."""
    original = importlib.import_module(_MOE_UTILS).get_tokens_per_expert_and_token_count

    @functools.wraps(original)
    def get_tokens_per_expert_and_token_count(routing_map, reduce_group, topk=None,
                                              with_padding_mask=False):
        # before the call: the reduce may overwrite the counts in place
        local_num_tokens = routing_map.sum() / topk if with_padding_mask else None
        global_counts, local, total = original(routing_map, reduce_group, topk,
                                               with_padding_mask)
        return global_counts, (local if local_num_tokens is None else local_num_tokens), total

    get_tokens_per_expert_and_token_count._mvmoe_wrapped = True
    rebind(_MOE_UTILS, "get_tokens_per_expert_and_token_count",
            get_tokens_per_expert_and_token_count, (_ROUTER,))


def _local_token_count_breaks() -> bool:
    """Both names (the definition and the router's import) still run 0.19.2's body, which
    sums the counts after passing them to the in-place reduce (a one-process probe cannot
    run a 2-rank reduce, so the body is read)."""
    import inspect

    for module_name in (_MOE_UTILS, _ROUTER):
        fn = importlib.import_module(module_name).get_tokens_per_expert_and_token_count
        if getattr(fn, "_mvmoe_wrapped", False):
            continue
        source = inspect.getsource(fn)
        reduce_at = source.find("reduce_from_tensor_model_parallel_region(")
        if 0 <= reduce_at < source.find("local_tokens_per_expert.sum()"):
            return True
    return False


_TOKENS_SEEN = "global_aux_tokens_seen"


def _global_aux_loss_over_tokens_seen() -> None:
    """Upstream #7213 (fix #7214): the global aux loss accumulates expert counts over the
    micro-batches of a global batch and divides them by ga_steps x the CURRENT micro-batch's
    token count, wrong whenever micro-batches hold different numbers of valid tokens
    (padding). The counts are divided by the tokens they were counted on instead (a
    `global_aux_tokens_seen` buffer, reset with the others)."""
    router = importlib.import_module(_ROUTER)
    cls = router.TopKRouter
    original_init = cls.__init__
    original_reset = cls.reset_global_aux_loss_tracker

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if self.global_tokens_per_expert is not None:
            self.register_buffer(_TOKENS_SEEN, torch.zeros_like(self.ga_steps),
                                 persistent=False)

    @functools.wraps(original_reset)
    def reset_global_aux_loss_tracker(self):
        original_reset(self)
        if getattr(self, _TOKENS_SEEN, None) is not None:
            getattr(self, _TOKENS_SEEN).zero_()

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map,
                               with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        counts, local_num_tokens, total_num_tokens = router.get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=self.tp_dp_cp_group,
            with_padding_mask=with_padding_mask, topk=self.topk)
        self.global_tokens_per_expert += counts
        self.ga_steps += 1
        tokens_seen = getattr(self, _TOKENS_SEEN)
        tokens_seen += total_num_tokens
        # the loss helper divides by this micro-batch's total: rescale the accumulated
        # counts so that count / total = accumulated count / tokens seen
        tokens_per_expert = self.global_tokens_per_expert * (total_num_tokens / tokens_seen)
        loss = router.switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert,
            total_num_tokens=total_num_tokens, topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, loss, "global_load_balancing_loss", self.tp_dp_cp_group,
            needs_dp_avg=False, valid_token_count=local_num_tokens)

    _apply_global_aux_loss._mvmoe_wrapped = True
    cls.__init__ = __init__
    cls.reset_global_aux_loss_tracker = reset_global_aux_loss_tracker
    cls._apply_global_aux_loss = _apply_global_aux_loss


def _global_aux_loss_breaks() -> bool:
    import inspect

    fn = importlib.import_module(_ROUTER).TopKRouter._apply_global_aux_loss
    return (not getattr(fn, "_mvmoe_wrapped", False)
            and "/ self.ga_steps" in inspect.getsource(fn))


ROUTER_FIXES = [
    Patch("upstream #6114 expert-bias padding",
          "TopKRouter._apply_expert_bias masks the [T, E] map with a [T] padding mask "
          "unbroadcast: a shape error when T != E, a wrong mask when T == E.",
          _expert_bias_counts_broadcast_padding, _expert_bias_counts_break),
    Patch("upstream #7481 local token count",
          "get_tokens_per_expert_and_token_count reads local_num_tokens after an in-place "
          "all-reduce: per-token-loss aux gradients scaled by the group's valid tokens.",
          _local_token_count_before_reduce, _local_token_count_breaks),
    Patch("upstream #7213 global aux tokens",
          "_apply_global_aux_loss divides counts accumulated over micro-batches by "
          "ga_steps x the current micro-batch's tokens: wrong with uneven padding.",
          _global_aux_loss_over_tokens_seen, _global_aux_loss_breaks),
]
