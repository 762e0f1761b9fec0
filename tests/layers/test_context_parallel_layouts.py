"""Context parallelism beside TP, EP and DP (issue 22): a GPTModel built from our
decoder-block spec, one training step through Megatron's schedule, DDP and
finalize_model_grads, with the trainer's CP batch split and CP loss (training/step.py), at
world 4: CP=2 x TP=2 (SP) x EP=2, CP=2 x EP=2 x DP=2, CP=2 x DP=2 and CP=2 x PP=2 (1F1B)
x EP=2. Loss and every
gradient equal the single-rank step's within the layout-parity tolerance (1e-5), also with
Megatron's aux losses and z-loss on for the stock latent router (TopKRouter) and for ours
(MultiRouter, Multi-View): their token counts over TP x CP make the split sequence's
losses the whole sequence's (AUX_LOSSES says why DP > 1 leaves out the global one). The same layouts at CP=1 meet that tolerance
(test_multi_view_layouts.py), so CP=2 equals CP=1 layout by layout. MLA (the CP attention
on MLA's local core attention) at CP=2 x TP=2 x EP=2 and CP=2 x DP=2 likewise."""

import pytest
import torch

from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.gpt_harness import (assert_matches_reference, build_gpt,
                                                global_batch, train_step_losses_and_grads)
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

VOCAB, SEQ, BATCH, MICRO = 64, 8, 4, 1
LAYOUTS = {"cp2_tp2_sp_ep2": dict(cp=2, tp=2, ep=2), "cp2_ep2_dp2": dict(cp=2, ep=2),
           "cp2_dp2": dict(cp=2), "cp2_pp2_ep2": dict(cp=2, pp=2, ep=2)}


AUX_LOSSES = {
    "all": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                moe_aux_loss_coeff=[0.01, 0.02, 0.03], moe_z_loss_coeff=1e-3),
    "per_microbatch": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                           moe_aux_loss_coeff=[0.01, 0.02], moe_z_loss_coeff=1e-3),
    "none": {}}
"""Megatron's aux losses: token counts reduced over TP x CP (global_aux_loss: with DP). The
global one keeps running counts over DP ranks and microbatches, so at DP > 1 it differs from
one rank's by Megatron's design (stock TopKRouter at EP=2 x DP=2, CP=1: 1.8e-3 in the router
gradient); DP > 1 layouts run the per-microbatch losses."""


def _step(rank, world_size, variant, layout, overrides):
    pgs = initialize_layout(ParallelLayout(**layout), seq_length=SEQ)
    tp, cp, ep, pp = (layout.get(name, 1) for name in ("tp", "cp", "ep", "pp"))
    config = mv_config(variant, num_routers=1 if variant == "latent" else 2, num_layers=2,
                       tensor_model_parallel_size=tp, context_parallel_size=cp,
                       pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                       expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                       sequence_parallel=tp > 1, moe_layer_freq=[1, 1], **overrides)
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SEQ, pgs)
    out = train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO,
                                      pgs)
    out["core_attention"] = type(model.module.decoder.layers[0].self_attention
                                 .core_attention).__name__
    out["router_tp_cp"] = model.module.decoder.layers[0].mlp.router.tp_cp_group.size()
    return out


@pytest.fixture(scope="module")
def references():
    return {}


def _reference(references, variant, losses):
    if (variant, losses) not in references:
        references[variant, losses] = run_distributed(
            _step, 1, args=(variant, {}, AUX_LOSSES[losses]))[0]
    return references[variant, losses]


@pytest.mark.parametrize("variant,layout,losses", [
    ("multi_view", "cp2_tp2_sp_ep2", "none"), ("multi_view", "cp2_ep2_dp2", "none"),
    ("multi_view", "cp2_dp2", "none"), ("multi_view", "cp2_pp2_ep2", "none"),
    ("latent", "cp2_tp2_sp_ep2", "all"),
    ("multi_router", "cp2_tp2_sp_ep2", "all"), ("multi_view", "cp2_tp2_sp_ep2", "all"),
    ("multi_view", "cp2_ep2_dp2", "per_microbatch")])
def test_cp2_step_matches_single_rank(references, variant, layout, losses):
    results = run_distributed(_step, 4, args=(variant, LAYOUTS[layout], AUX_LOSSES[losses]))
    assert {r["core_attention"] for r in results} == {"CPDotProductAttention"}
    tp_cp = LAYOUTS[layout].get("tp", 1) * LAYOUTS[layout]["cp"]
    assert {r["router_tp_cp"] for r in results} == {tp_cp}
    assert_matches_reference(results, _reference(references, variant, losses))


def _mla_step(rank, world_size, variant, layout):
    from test_mla_qk_norm import mla_config

    pgs = initialize_layout(ParallelLayout(**layout), seq_length=SEQ)
    tp, cp, ep = (layout.get(name, 1) for name in ("tp", "cp", "ep"))
    config = mla_config(variant, tensor_model_parallel_size=tp, context_parallel_size=cp,
                        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                        sequence_parallel=tp > 1)
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SEQ, pgs)
    out = train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO,
                                      pgs)
    out["core_attention"] = type(model.module.decoder.layers[0].self_attention
                                 .core_attention).__name__
    return out


@pytest.mark.parametrize("variant,layout", [("multi_view", "cp2_tp2_sp_ep2"),
                                            ("smoe", "cp2_dp2")])
def test_mla_at_cp2_matches_single_rank(variant, layout):
    """MLA (tiny, QK norm on, RoPE through MLA's own rotary embedding) at CP=2: the CP
    attention on MLA's core attention, loss and every gradient equal one rank's (1e-5)."""
    reference = run_distributed(_mla_step, 1, args=(variant, {}))[0]
    results = run_distributed(_mla_step, 4, args=(variant, LAYOUTS[layout]))
    assert {r["core_attention"] for r in results} == {"CPMLADotProductAttention"}
    assert reference["core_attention"] == "MLADotProductAttention"
    assert_matches_reference(results, reference)
