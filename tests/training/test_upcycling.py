"""Upcycling (--moe-use-upcycling): a dense model's weights initialise smoe (Megatron-Core's
upcycle_state_dict), latent, Multi-Router and Multi-View models (zero-padded identity; views
neutral at gamma = 0). At granularity 1 the first forward equals the dense model's; at
granularity 2 the experts are Megatron's scaled slices (naive reference); what cannot be
exact is refused naming the field."""

import math

import pytest
import torch

from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.models.upcycling import upcycle_problems
from megatron_mvmoe.testing.spawn import DistributedTestError, run_distributed
from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)

DENSE = dict(ffn_hidden_size=64)  # = the tiny presets' expert width: granularity 1
TARGETS = {  # preset -> overrides that make the mapping exact (latent_size >= hidden 64)
    "tiny_smoe": {},
    "tiny_latent": dict(latent_size=64),
    "tiny_multi_router": dict(latent_size=64),
    "tiny_multi_view": dict(latent_size=96),
}
CASES = {name: (name, overrides, "fresh") for name, overrides in TARGETS.items()}
CASES["tiny_multi_view/copy"] = ("tiny_multi_view", TARGETS["tiny_multi_view"], "copy")


def _logits(chunk, tokens_BS):
    positions = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
    return chunk(tokens_BS, positions, None)


def _first_forwards(rank, world_size, targets, dense_overrides):
    """Per target: max |logits - dense logits| after upcycling, and before (fresh init)."""
    from megatron_mvmoe.models.provider import build_model_chunks, transformer_config
    from megatron_mvmoe.models.upcycling import upcycle_chunk
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    from megatron_mvmoe import platform

    pgs = initialize_layout(ParallelLayout())
    platform.seed_all(0)  # also Megatron's model-parallel RNG tracker (attention forks it)
    dense_shape = model_from_preset("tiny_dense", **dense_overrides)
    dense = build_model_chunks(transformer_config(dense_shape), dense_shape, pgs)[0].eval()
    tokens = torch.randint(0, dense_shape.vocab_size, (2, 16))
    out = {}
    with torch.no_grad():
        reference = _logits(dense, tokens)
        for label, (name, overrides, new_heads) in targets.items():
            model = model_from_preset(name, **overrides)
            moe = build_model_chunks(transformer_config(model), model, pgs)[0].eval()
            before = float((_logits(moe, tokens) - reference).abs().max())
            report = upcycle_chunk(moe, dense, model.moe_variant, new_heads)
            after = float((_logits(moe, tokens) - reference).abs().max())
            out[label] = {"before": before, "after": after, "mapping": report.mapping,
                          "experts": len(report.experts), "heads_equal": _heads_equal(moe)}
            if name == "tiny_smoe" and dense_overrides["ffn_hidden_size"] == 128:
                out[label]["weights"] = _granularity_2_check(moe, dense)
    return out


def _heads_equal(moe):
    """Whether each Multi-Router weight's heads are all equal (None: one head)."""
    weight = moe.state_dict().get("decoder.layers.0.mlp.router.weight")
    if weight is None or weight.shape[0] == 4:
        return None
    return all(torch.equal(head, weight[:4]) for head in weight.split(4))


def _granularity_2_check(moe, dense):
    """Naive reference of Megatron's fine-grained rule (G = 2, SwiGLU, softmax after top-k):
    expert i holds slice i % 2 of the dense gate, up and down weights, each x G^(1/3)."""
    dense_sd, moe_sd = dense.state_dict(), moe.state_dict()
    scale = 2 ** (1 / 3)
    w1 = dense_sd["decoder.layers.0.mlp.linear_fc1.weight"]
    w2 = dense_sd["decoder.layers.0.mlp.linear_fc2.weight"]
    gate, up = w1.chunk(2, dim=0)
    worst = 0.0
    for i in range(4):
        part = i % 2
        fc1 = torch.cat([gate.chunk(2, 0)[part], up.chunk(2, 0)[part]]) * scale
        fc2 = w2.chunk(2, 1)[part] * scale
        prefix = f"decoder.layers.0.mlp.experts.local_experts.{i}."
        worst = max(worst, float((moe_sd[prefix + "linear_fc1.weight"] - fc1).abs().max()),
                    float((moe_sd[prefix + "linear_fc2.weight"] - fc2).abs().max()))
    return worst


def test_first_forward_equals_the_dense_model():
    out = run_distributed(_first_forwards, 1, timeout_s=300, args=(CASES, DENSE))[0]
    for name, row in out.items():
        assert row["after"] < 1e-5, (name, row)      # the warm start's tolerance
        assert row["before"] > 1e-3, (name, row)     # a fresh MoE model is not the dense one
        assert row["experts"] == 2 * 2 * 4, row      # 2 layers x fc1/fc2 x 4 experts
    assert out["tiny_smoe"]["mapping"] == "megatron"
    assert out["tiny_multi_view"]["mapping"] == "latent"
    assert out["tiny_multi_view"]["heads_equal"] is False  # fresh: own init per head
    assert out["tiny_multi_view/copy"]["heads_equal"] is True


def test_granularity_2_is_megatrons_scaled_slices():
    out = run_distributed(_first_forwards, 1, timeout_s=300,
                          args=({"tiny_smoe": ("tiny_smoe", {}, "fresh")},
                                dict(ffn_hidden_size=128)))[0]
    assert out["tiny_smoe"]["weights"] < 1e-6, out


def test_refusals_name_the_field():
    dense = model_from_preset("tiny_dense", ffn_hidden_size=64)
    cases = {
        "mh_moe experts see D/H-wide sub-tokens": model_from_preset("tiny_mh_moe"),
        "latent_size: 32 < hidden_size 64": model_from_preset("tiny_multi_view"),
        "moe_ffn_hidden_size: latent upcycling copies": model_from_preset(
            "tiny_latent", latent_size=64, moe_ffn_hidden_size=32),
        "moe_ffn_hidden_size: 48 does not divide": model_from_preset("tiny_smoe",
                                                                     moe_ffn_hidden_size=48),
        "moe_shared_expert_intermediate_size": model_from_preset(
            "tiny_smoe", moe_shared_expert_intermediate_size=64),
    }
    for text, target in cases.items():
        assert any(text in line for line in upcycle_problems(dense, target)), text
    assert upcycle_problems(dense, model_from_preset("tiny_latent", latent_size=64)) == []
    copy_without_views = upcycle_problems(
        dense, model_from_preset("tiny_multi_router", latent_size=64), new_heads="copy")
    assert "warm_start_new_heads: 'copy'" in copy_without_views[0]
    latent = model_from_preset("tiny_latent")
    assert "upcycling starts from a dense model" in upcycle_problems(latent, latent)[0]


# ------------------------------------------------------------------ through the trainer
def _run(text_tokens, preset, model=None, **training):
    raw = tiny_run(text_tokens, preset=preset, eval_iters=0, **training)
    raw["optimizer"]["warmup_iters"] = 0
    raw["model"].update(model or {})
    return raw


@pytest.fixture(scope="module")
def dense_ckpt(text_tokens, tmp_path_factory):
    """A tiny dense model (FFN 64) trained 3 steps and saved."""
    root = str(tmp_path_factory.mktemp("dense"))
    train(_run(text_tokens, "tiny_dense", DENSE, train_iters=3, save=root), 1)
    return root


@pytest.fixture(scope="module")
def dense_loss(text_tokens, dense_ckpt):
    """The dense model's own loss on batch 1 at its saved weights (weights only)."""
    return train(_run(text_tokens, "tiny_dense", DENSE, train_iters=1, load=dense_ckpt,
                      finetune=True), 1)["losses"][0]


@pytest.mark.parametrize("preset,world,parallel", [
    ("tiny_smoe", 1, {}), ("tiny_multi_view", 1, {}), ("tiny_smoe", 2, {"ep": 2})],
    ids=["smoe", "multi_view", "smoe_ep2"])
def test_upcycled_first_step_loss_is_the_dense_loss(text_tokens, dense_ckpt, dense_loss,
                                                    tmp_path, preset, world, parallel):
    command = dict(warm_start_from=dense_ckpt, moe_use_upcycling=True,
                   save=str(tmp_path / "moe"), load=str(tmp_path / "moe"))
    raw = _run(text_tokens, preset, TARGETS[preset], train_iters=2, parallel=parallel, **command)
    out = train(raw, world)
    assert out["first_step"] == 1 and all(math.isfinite(x) for x in out["losses"])
    assert abs(out["losses"][0] - dense_loss) < 1e-5, (out["losses"], dense_loss)
    relaunch = train(_run(text_tokens, preset, TARGETS[preset], train_iters=3,
                          parallel=parallel, **command), world)
    assert relaunch["first_step"] == 3  # the same line resumes the MoE run


def test_upcycling_refusals_through_the_trainer(text_tokens, dense_ckpt):
    raw = _run(text_tokens, "tiny_multi_view", train_iters=1, warm_start_from=dense_ckpt,
               moe_use_upcycling=True)
    with pytest.raises(DistributedTestError, match=r"cannot be upcycled into this model; "
                                                   r"latent_size: 32 < hidden_size 64"):
        train(raw, 1)
    raw = _run(text_tokens, "tiny_mh_moe", train_iters=1, warm_start_from=dense_ckpt,
               moe_use_upcycling=True)
    with pytest.raises(DistributedTestError, match=r"moe_variant is 'mh_moe'"):
        train(raw, 1)


def test_megatron_lm_line_reads_load_as_the_dense_checkpoint(tmp_path):
    from megatron_mvmoe.config.flags import config_from_args

    run = config_from_args(["--model-preset", "tiny_smoe", "--moe-use-upcycling",
                            "--load", str(tmp_path / "dense"), "--save", str(tmp_path / "moe"),
                            "--train-iters", "2"])
    assert run.training.moe_use_upcycling
    assert run.training.warm_start_from == str(tmp_path / "dense")
    assert run.training.load == str(tmp_path / "moe")
    with pytest.raises(ValueError, match="training.moe_use_upcycling: no dense checkpoint"):
        config_from_args(["--model-preset", "tiny_smoe", "--moe-use-upcycling",
                          "--train-iters", "2"])
