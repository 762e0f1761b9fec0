"""MoE recompute through Megatron's own mechanism (issue 22, feature 7): with
`--moe-layer-recompute` (or selective granularity with `moe` in the recompute modules) every
variant's MoE layer runs inside `tensor_parallel.checkpoint` (MoELayer.forward; MH-MoE's
inner MoELayer), so its experts run twice per step (once without grad, once in the
backward), and the loss and every gradient equal the run without recompute bit for bit, at
EP=1 and EP=2 (the expert-bias token counts, taken only with grad enabled, too)."""

import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiHeadConfig
from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.gpt_harness import build_gpt, global_batch, train_step_losses_and_grads
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

VOCAB, SEQ, BATCH, MICRO = 64, 8, 4, 2
VARIANTS = ("smoe", "latent", "multi_router", "multi_view", "mh_moe")
RECOMPUTE = {"off": {}, "moe_layer_recompute": dict(moe_layer_recompute=True),
             "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"])}


def _config(variant: str, ep: int, recompute: str):
    extra = dict(multi_head=MultiHeadConfig(num_heads=2)) if variant == "mh_moe" else {}
    return mv_config(variant, num_routers=1 if variant == "latent" else 2,
                     expert_model_parallel_size=ep, **extra, **RECOMPUTE[recompute])


def _routers(model):
    return [m for name, m in model.named_modules() if name.endswith(".router")]


def _experts(model):
    return [m for name, m in model.named_modules() if name.endswith(".experts")]


def _step(rank, world_size, variant, recompute):
    pgs = initialize_layout(ParallelLayout(ep=world_size))
    config = _config(variant, world_size, recompute)
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SEQ, pgs)
    calls = []
    for experts in _experts(model):
        experts.register_forward_pre_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    out = train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO, pgs)
    out["expert_calls"] = calls
    out["tokens_per_expert"] = [r.local_tokens_per_expert.clone() for r in _routers(model)
                                if getattr(r, "local_tokens_per_expert", None) is not None]
    out["recompute_modules"] = (config.recompute_granularity, sorted(config.recompute_modules))
    return out


def _same(a, b):
    assert a["loss"] == b["loss"], (a["loss"], b["loss"])
    assert set(a["grads"]) == set(b["grads"])
    for name, grad in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], grad, atol=1e-6, rtol=0, msg=name)
    for x, y in zip(a["tokens_per_expert"], b["tokens_per_expert"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("variant", VARIANTS)
def test_recompute_leaves_loss_and_grads_unchanged(variant):
    runs = {name: run_distributed(_step, 1, args=(variant, name))[0] for name in RECOMPUTE}
    off = runs["off"]
    calls = off["expert_calls"]
    assert calls == [True] * (2 * BATCH // MICRO)  # MoE layers x microbatches
    for name in ("moe_layer_recompute", "selective_moe"):
        on = runs[name]
        _same(off, on)
        # each MoE layer once without grad, then once more in the backward (the recompute)
        assert on["expert_calls"].count(False) == on["expert_calls"].count(True) == len(calls)
    assert runs["moe_layer_recompute"]["recompute_modules"] == ("selective", ["core_attn", "moe"])
    assert runs["selective_moe"]["recompute_modules"] == ("selective", ["moe"])


def test_recompute_at_ep2_matches_ep2_without():
    off = run_distributed(_step, 2, args=("multi_view", "off"))
    on = run_distributed(_step, 2, args=("multi_view", "moe_layer_recompute"))
    for a, b in zip(off, on):
        _same(a, b)


def _saved_worker(rank, world_size, variant, recompute):
    from megatron_mvmoe.planning.plan import PlanTarget
    from megatron_mvmoe.planning.memory import (grouped_experts_on, moe_layer_elements,
                                                     stacked_expert_elements)
    from megatron_mvmoe.config.model_section import model_section_from_dict
    from megatron_mvmoe.models.provider import transformer_config
    from megatron_mvmoe.testing.saved_activations import SavedActivations

    pgs = initialize_layout(ParallelLayout())
    variant, architecture = (variant, {}) if variant != "smoe_gpt3" else ("smoe", GPT3)
    latent = variant in ("latent", "multi_router", "multi_view")
    section = model_section_from_dict(dict(
        **architecture, moe_variant=variant, num_layers=2, hidden_size=64, num_attention_heads=4,
        ffn_hidden_size=128, num_experts=8, moe_ffn_hidden_size=128, moe_router_topk=4,
        latent_size=32 if latent else None, vocab_size=VOCAB, seq_length=SAVED_SEQ,
        multi_view=dict(num_routers=2, num_views=2 if variant == "multi_view" else 1),
        multi_head=dict(num_heads=2 if variant == "mh_moe" else 1),
        moe_shared_expert_intermediate_size=32, extra=dict(RECOMPUTE[recompute])))
    config = transformer_config(section)
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SAVED_SEQ, pgs)
    with SavedActivations(model.module) as saved:
        train_step_losses_and_grads(model, config, global_batch(2, SAVED_SEQ, VOCAB), 1, pgs)
    grouped = grouped_experts_on(section, "cpu_fp32")
    stacked = stacked_expert_elements(section, PlanTarget(ParallelLayout())) \
        if grouped else {"fc1": 0, "fc2": 0}
    return {"saved": saved.bytes_per_forward(), "grouped": grouped,
            "planned_moe_layer": 4 * (moe_layer_elements(section, SAVED_SEQ, 1, grouped)
                                      + stacked["fc1"] + stacked["fc2"])}


SAVED_SEQ = 64
GPT3 = dict(swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
            untie_embeddings_and_output_weights=False)
"""GeLU experts and shared expert (fc1 of F rows), LayerNorm, learned positions, tied."""


@pytest.mark.parametrize("variant", VARIANTS + ("smoe_gpt3",))
def test_recompute_drops_what_the_planner_says(variant):
    """Bytes saved for the backward per microbatch (counted at autograd's saved-tensor hook):
    recompute removes the planner's `moe_layer_elements` (plus the stacked expert copies of
    the grouped CPU path) of both MoE layers, within the planner's activations target
    (planning.validate.TARGET_PERCENT, 15 %; smoe / latent / Multi-Router / Multi-View are within
    10 %, MH-MoE's sub-token bookkeeping leaves it about 12 % under). smoe_gpt3: GeLU experts
    keep less than SwiGLU ones (fc1 of F rows)."""
    from megatron_mvmoe.planning.validate import TARGET_PERCENT

    off = run_distributed(_saved_worker, 1, args=(variant, "off"))[0]
    on = run_distributed(_saved_worker, 1, args=(variant, "selective_moe"))[0]
    dropped, planned = off["saved"] - on["saved"], 2 * off["planned_moe_layer"]
    tolerance = TARGET_PERCENT["forward_backward"] / 100
    assert dropped > 0 and abs(dropped - planned) <= tolerance * planned, (dropped, planned)


def test_flags_reach_megatron_and_the_planner():
    """--moe-layer-recompute / --recompute-modules mean Megatron-LM's: the config Megatron
    builds and the planner's rule (recomputed_modules) agree; the planner's activations fall
    by the MoE layers' saved tensors less one layer rebuilt in the backward."""
    from megatron_mvmoe.planning.plan import PlanTarget
    from megatron_mvmoe.planning.memory import activation_bytes, recomputed_modules
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config

    base = ["--model-preset", "tiny_multi_view"]
    for argv, want in [([], set()), (["--moe-layer-recompute"], {"core_attn", "moe"}),
                       (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
                        {"moe"}),
                       (["--recompute-granularity", "selective"], {"core_attn"})]:
        run = config_from_args(base + argv)
        config = model_config(run)
        got = set(config.recompute_modules) if config.recompute_granularity == "selective" \
            else set()
        assert got == want == set(recomputed_modules(run.model)), argv
    off = config_from_args(base).model
    on = config_from_args(base + ["--recompute-granularity", "selective",
                                  "--recompute-modules", "moe"]).model
    target = PlanTarget(ParallelLayout(), micro_batch_size=2, global_batch_size=2)
    a, b = (activation_bytes(m, target, 0, "gpu_bf16") for m in (off, on))
    from megatron_mvmoe.planning.memory import moe_layer_elements
    one_layer = 2 * moe_layer_elements(on, 2 * on.seq_length, 1)  # bf16
    assert a["activations"] - b["activations"] == pytest.approx(
        (on.num_layers - 1) * one_layer)
    assert b["recompute_transient"] == pytest.approx(one_layer)


@pytest.mark.parametrize("argv,message", [
    (["--recompute-granularity", "selective", "--recompute-modules", "moe", "atn"],
     "--recompute-modules: unknown module 'atn'; Megatron's are core_attn"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     "moe_act in recompute_modules is only supported with moe_grouped_gemm"),
])
def test_bad_recompute_lines_are_one_line(argv, message):
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import validate_run

    with pytest.raises(ValueError, match=message) as err:
        validate_run(config_from_args(["--model-preset", "tiny_multi_view"] + argv))
    assert "\n" not in str(err.value)
