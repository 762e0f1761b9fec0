"""Multi-token prediction (--mtp-num-layers) through Megatron-Core's MTP block, every variant:
the MTP layer is built with the variant's MoE layer, the planner counts exactly the built
parameters, a tiny model trains with the MTP loss logged, MoE counts and aux losses of the
MTP layer land in their own slot (counted once), and TP x SP x EP runs it too."""

import json
import math

import pytest

from megatron_mvmoe.config.model_costs import flops_per_token, mtp_params, parameter_counts
from megatron_mvmoe.planning.plan import PlanTarget, plan
from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.parallel import ParallelLayout
from megatron_mvmoe.testing.spawn import run_distributed
from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)

TINY = ["tiny_dense", "tiny_smoe", "tiny_latent", "tiny_multi_router", "tiny_multi_view",
        "tiny_mh_moe"]
MOE_CLASS = {"tiny_smoe": "MoELayer", "tiny_latent": "LatentMoELayer",
             "tiny_multi_router": "LatentMoELayer", "tiny_multi_view": "MultiViewMoELayer",
             "tiny_mh_moe": "MultiHeadMoELayer", "tiny_dense": "MLP"}


def _built(rank, world_size, cases):
    """Per (preset, mtp layers): the built parameter count, and per MTP layer the class of
    its MLP and its router."""
    from megatron_mvmoe.models.provider import (build_model_chunks, count_parameters,
                                                transformer_config)
    from megatron_mvmoe.parallel import initialize_layout

    pgs = initialize_layout(ParallelLayout())
    out = {}
    for name, layers in cases:
        model = model_from_preset(name, extra={"mtp_num_layers": layers})
        chunks = build_model_chunks(transformer_config(model), model, pgs)
        mtp = [layer.mtp_model_layer for layer in chunks[0].mtp.layers]
        out[f"{name}/{layers}"] = {
            "count": count_parameters(chunks),
            "mlp": [type(layer.mlp).__name__ for layer in mtp],
            "router": [type(getattr(layer.mlp, "router", None)).__name__ for layer in mtp],
            "decoder_router": type(getattr(chunks[0].decoder.layers[-1].mlp, "router",
                                           None)).__name__}
    model = model_from_preset("tiny_multi_view", extra={"mtp_num_layers": 1},
                              bitnet={"enabled": True})
    chunk = build_model_chunks(transformer_config(model), model, pgs)[0]
    out["bitnet_eh_proj"] = type(chunk.mtp.layers[0].eh_proj).__name__
    return out


def test_mtp_layers_use_the_variant_moe_and_planner_counts_them():
    cases = [(name, 1) for name in TINY] + [("tiny_multi_view", 2)]
    built = run_distributed(_built, 1, timeout_s=300, args=(cases,))[0]
    for name, layers in cases:
        got = built[f"{name}/{layers}"]
        model = model_from_preset(name, extra={"mtp_num_layers": layers})
        assert parameter_counts(model)["total"] == got["count"], (name, layers)
        assert got["mlp"] == [MOE_CLASS[name]] * layers, got
        assert got["router"] == [got["decoder_router"]] * layers, got  # the variant's router
    assert built["bitnet_eh_proj"] == "BitColumnParallelLinear"  # quantized like the block
    # naive: one MTP layer = 3 norms + eh_proj [D, 2D] + one more decoder layer
    base, one = (model_from_preset("tiny_multi_view", extra={"mtp_num_layers": n})
                 for n in (0, 1))
    D = base.hidden_size
    decoder_layer = (parameter_counts(base)["total"] - 2 * base.vocab_size * D - D) \
        // base.num_layers
    assert parameter_counts(one)["total"] - parameter_counts(base)["total"] == \
        3 * D + 2 * D * D + decoder_layer


def test_planner_flops_and_memory_count_mtp():
    base = model_from_preset("mvmoe_10b_a1b")
    mtp = model_from_preset("mvmoe_10b_a1b", extra={"mtp_num_layers": 1})
    c0, c1 = parameter_counts(base), parameter_counts(mtp)
    assert c1["mtp"] == mtp_params(mtp)["total"] > 0
    assert c1["total"] - c0["total"] == c1["mtp"]
    # active: one more layer's active share + eh_proj + 3 norms; FLOPs: that x 2, one more
    # LM-head pass x 2, one more layer of attention scores
    active_layer = (c0["active"] - c0["embedding"] - c0["lm_head"] - base.hidden_size) \
        / base.num_layers
    extra_active = c1["active"] - c0["active"]
    D = base.hidden_size
    assert extra_active == active_layer + 2 * D * D + 3 * D
    f0, f1 = flops_per_token(base)["forward"], flops_per_token(mtp)["forward"]
    assert f1 - f0 == 2 * (extra_active + c0["lm_head"]) + 4 * base.seq_length * D
    target = PlanTarget(ParallelLayout(pp=2, ep=8), world_size=16)
    m0 = plan(base, target)["memory_bytes_per_gpu"]["weights"]
    m1 = plan(mtp, target)["memory_bytes_per_gpu"]["weights"]
    assert m1 > m0


def _records(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("preset", ["tiny_smoe", "tiny_latent", "tiny_multi_router",
                                    "tiny_multi_view", "tiny_mh_moe"])
def test_tiny_variant_trains_with_mtp_loss_logged(text_tokens, tmp_path, preset):
    steps = 8
    raw = tiny_run(text_tokens, preset=preset, train_iters=steps, eval_iters=1)
    raw["model"]["extra"] = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=4)
    out = train(raw, 1)
    losses = out["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    train_records = [r for r in _records(tmp_path / "run") if r["kind"] == "train"]
    mtp = [r["mtp_1_loss"] for r in train_records]
    assert len(mtp) == 2, train_records
    # untrained: about ln(vocab) like the main loss, and it falls as training goes on
    assert abs(mtp[0] - math.log(512)) < 0.5 and mtp[1] < mtp[0], mtp
    assert 0.0 <= train_records[-1]["mtp_1_acceptance_rate"] <= 100.0
    routing = train_records[-1]["routing"]
    num_layers = 2
    assert sorted(routing) == [str(n) for n in range(1, num_layers + 2)]  # + the MTP layer
    heads = 2 if preset == "tiny_mh_moe" else 1
    per_layer = 4 * 8 * 32 * 2 * heads  # steps x global batch x seq x top-k (x sub-tokens)
    for entry in routing.values():  # the MTP layer's counts never merge into layer 1's
        assert sum(entry["tokens_per_expert"]) == per_layer, routing


def test_smoe_aux_loss_of_the_mtp_layer_counted_once(text_tokens, tmp_path):
    """Megatron's switch aux loss / coeff is ~1 for an untrained router (balanced: exactly
    1); an MTP layer logged into a decoder layer's slot would make that slot ~2."""
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=3, eval_iters=0)
    raw["model"]["extra"] = {"mtp_num_layers": 1}
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=3)
    train(raw, 1)
    routing = _records(tmp_path / "run")[-1]["routing"]
    aux = {n: entry["load_balancing_loss"] for n, entry in routing.items()}
    assert sorted(aux) == ["1", "2", "3"]
    assert all(0.9 < value < 1.5 for value in aux.values()), aux


def test_mtp_at_tp2_sp_ep2(text_tokens, tmp_path):
    """Sequence-parallel MTP norms (SequenceParallelTorchNorm), EP dispatch inside the MTP
    layer: 4 ranks train, the MTP loss is the same on every rank's log (rank 0 writes)."""
    raw = tiny_run(text_tokens, preset="tiny_multi_view", parallel={"tp": 2, "ep": 2},
                   train_iters=4, eval_iters=0)
    raw["model"]["extra"] = {"mtp_num_layers": 1}
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=4)
    out = train(raw, 4, timeout_s=400)
    assert all(math.isfinite(x) for x in out["losses"])
    record = _records(tmp_path / "run")[-1]
    assert abs(record["mtp_1_loss"] - math.log(512)) < 0.5, record


def test_mtp_resume_is_bit_identical(text_tokens, tmp_path):
    """The MTP layers (with the variant's MoE layer) go through dist-checkpointing: resuming
    at step 2 gives steps 3-4 of the uninterrupted run bit for bit."""
    def raw(**training):
        r = tiny_run(text_tokens, preset="tiny_multi_view", train_iters=4, eval_iters=0,
                     **training)
        r["model"]["extra"] = {"mtp_num_layers": 1}
        return r

    full = train(raw(save=str(tmp_path / "ckpt"), save_interval=2), 1)["losses"]
    resumed = train(raw(load=str(tmp_path / "ckpt"), ckpt_step=2), 1)
    assert resumed["first_step"] == 3 and resumed["losses"] == full[2:], (full, resumed)


def test_mtp_with_pipeline_parallelism_trains_as_at_pp1(text_tokens, tmp_path):
    """MTP at PP 2 on CPU (refused until platform/cpu_embedding_copy.py: Megatron moved the
    MTP stage's copy of the word embedding with .cuda()): PP 1 resumed from PP 2's step-1
    checkpoint continues with its losses."""
    def run(pp, **training):
        raw = tiny_run(text_tokens, preset="tiny_smoe", parallel={"pp": pp}, eval_iters=0,
                       ckpt_optimizer_format="fully_reshardable", **training)
        raw["model"]["extra"] = {"mtp_num_layers": 1}
        return train(raw, pp)["losses"]

    two = run(2, train_iters=4, save=str(tmp_path / "ck"), save_interval=1)
    (tmp_path / "ck" / "latest").write_text("iter_0000001\n")
    one = run(1, train_iters=4, load=str(tmp_path / "ck"))
    assert len(one) == 3 and max(abs(a - b) for a, b in zip(one, two[1:])) < 1e-5, (one, two)


def test_mtp_checkpoint_reshards_between_ep_sizes(text_tokens, tmp_path):
    """Saved at EP=1, continued at EP=1 and at EP=2: the MTP layer's experts reshard through
    dist-checkpointing, and the step after (whose loss feels the MTP gradients of the step
    before, through the shared embedding and decoder) agrees across layouts."""
    def raw(parallel=None, **training):
        r = tiny_run(text_tokens, preset="tiny_multi_view", parallel=parallel, eval_iters=0,
                     **training)
        r["model"]["extra"] = {"mtp_num_layers": 1}
        return r

    root = str(tmp_path / "ckpt")
    train(raw(train_iters=3, save=root), 1)
    # Weights only (fresh Adam on both sides): what is checked is the MTP weights' reshard.
    # (With the saved Adam moments loaded across EP sizes, step 5 differs by ~1e-3 with MTP
    # and ~2e-5 without: the optimizer-state path, reported, not the weights.)
    one = train(raw(train_iters=5, load=root, load_optimizer=False), 1)
    two = train(raw(parallel={"ep": 2}, train_iters=5, load=root, load_optimizer=False), 2)
    assert one["first_step"] == two["first_step"] == 4
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-5, (one, two)
