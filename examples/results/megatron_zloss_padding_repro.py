#!/usr/bin/env python
"""Minimal reproduction: Megatron-LM's
`test_aux_loss.py::TestPaddingMaskAuxLoss::test_padding_mask_with_z_loss` (core_r0.19.0)
fails with STOCK Megatron-Core 0.19.2, without megatron_mvmoe, in one CPU process.

The test's body, unchanged but for the layout: one rank, and the z-loss coefficient
divided by TP x CP (8 or 4 in the test's five layouts) as `TopKRouter.apply_z_loss` divides
it, so the router's arithmetic is that of one of the test's ranks. Its two asserts:
  1. z-loss with a padding mask == z-loss of the valid tokens alone: holds;
  2. router weight gradient of `scores.sum()` with the mask == that of the valid tokens
     alone (`torch.equal`): fails. The masked run also back-propagates the PADDED tokens'
     scores, which the router keeps (the mask only enters the losses). Their gradient is
     d(sum of a softmax over the top-k)/d logits = p * (1 - sum p): zero in exact
     arithmetic, but float32 probabilities do not sum to exactly 1, so a ~1e-8 residue
     reaches the float32 weight gradient, whose cast to the bf16 parameter dtype then
     differs in the last bit for some entries.
The checks printed alongside: back-propagating only the valid tokens' scores gives a
bit-identical gradient, and the padded tokens' residue is non-zero.

Usage: python examples/results/megatron_zloss_padding_repro.py [--tp-cp 8] [--seed 123]
           [--seeds N] [--through-our-layer] [--json]
--seeds N counts, over seeds 0..N-1 instead of the test's 123, how often each assert fails.
--through-our-layer applies megatron_mvmoe's platform layer first (CPU patches and the
upstream aux-loss fixes): the same outcome. Checked by
tests/platform/test_megatron_zloss_padding.py.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 32, 2, 12, 32, 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp-cp", type=int, default=8, help="TP x CP of the layout emulated")
    p.add_argument("--seed", type=int, default=123, help="the test's _set_random_seed")
    p.add_argument("--seeds", type=int, metavar="N",
                   help="instead: count the seeds 0..N-1 on which each assert fails")
    p.add_argument("--through-our-layer", action="store_true")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def init_one_rank(through_our_layer: bool) -> None:
    if through_our_layer:
        from megatron_mvmoe.platform import apply_cpu_patches

        apply_cpu_patches()
    else:
        # TopKRouter.gating moves its weight to torch.cuda.current_device(): the one CUDA
        # call on this path, and the only stand-in the stock run needs
        torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)


def new_router(tp_cp: int):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_moe_experts=EXPERTS,
        use_cpu_initialization=True, moe_router_load_balancing_type="aux_loss",
        moe_router_topk=TOPK, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1.0 / tp_cp,
        moe_router_dtype="fp32", bf16=True, params_dtype=torch.bfloat16,
        add_bias_linear=False)
    router = TopKRouter(config=config, pg_collection=get_default_pg_collection())
    router.set_layer_number(0)
    return router


def z_loss_and_grad(router, hidden, padding_mask=None, backward_rows=None):
    """The tracked z-loss and the router weight's gradient of the summed scores (of the
    first `backward_rows` tokens only, when given)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker)

    clear_aux_losses_tracker()
    router.weight.grad = None
    scores, _ = router(hidden, padding_mask=padding_mask)
    (scores if backward_rows is None else scores[:backward_rows]).sum().backward()
    z_loss = get_moe_layer_wise_logging_tracker()["z_loss"]["values"][0].clone()
    return z_loss, router.weight.grad.clone()


def padded_score_residue(router, hidden, valid: int) -> float:
    """Largest |d sum(scores)/d logits| over the padded tokens (zero in exact arithmetic)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = router.gating(hidden).view(-1, EXPERTS)[valid:].detach().requires_grad_(True)
    scores, _ = topk_routing_with_score_function(logits, TOPK, use_pre_softmax=False,
                                                 score_function="softmax")
    scores.sum().backward()
    return logits.grad.abs().max().item()


def reproduce(tp_cp: int, seed: int) -> dict:
    torch.manual_seed(seed)
    router = new_router(tp_cp)
    hidden = torch.randn((SEQ, BATCH, HIDDEN), dtype=torch.bfloat16)
    padding_mask = torch.zeros((SEQ, BATCH), dtype=torch.bool)
    padding_mask[SEQ // 2:, :] = True  # the test's mask: first half valid, second padding
    valid = SEQ // 2 * BATCH
    z_masked, grad_masked = z_loss_and_grad(router, hidden, padding_mask)
    z_valid, grad_valid = z_loss_and_grad(router, hidden[:SEQ // 2])
    _, grad_masked_valid_rows = z_loss_and_grad(router, hidden, padding_mask, valid)
    return dict(
        megatron_mvmoe_loaded=any(m.startswith("megatron_mvmoe.") for m in sys.modules),
        tp_cp=tp_cp, seed=seed,
        z_loss_equal=torch.equal(z_masked, z_valid),
        grad_equal=torch.equal(grad_masked, grad_valid),
        grad_entries_differing=int((grad_masked != grad_valid).sum()),
        grad_max_abs_diff=(grad_masked.float() - grad_valid.float()).abs().max().item(),
        grad_equal_backward_valid_rows_only=torch.equal(grad_masked_valid_rows, grad_valid),
        padded_score_grad_residue=padded_score_residue(router, hidden, valid))


def main(argv=None) -> int:
    args = parse_args(argv)
    init_one_rank(args.through_our_layer)
    if args.seeds:
        runs = [reproduce(args.tp_cp, seed) for seed in range(args.seeds)]
        result = dict(tp_cp=args.tp_cp, seeds=args.seeds,
                      z_loss_assert_fails=sum(not r["z_loss_equal"] for r in runs),
                      grad_assert_fails=sum(not r["grad_equal"] for r in runs),
                      grad_assert_fails_backward_valid_rows_only=sum(
                          not r["grad_equal_backward_valid_rows_only"] for r in runs))
    else:
        result = reproduce(args.tp_cp, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
