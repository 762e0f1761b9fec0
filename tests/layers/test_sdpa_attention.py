"""The SDPA core attention (issue 42 item 1, layers/sdpa_attention.py): forward and gradients
equal Megatron's DotProductAttention at TP 1 and TP 2 (each rank its heads) for causal GQA
with query-key layer scaling, an explicit softmax scale, a given boolean mask and MLA's
head widths; attention dropout draws from Megatron's RNG tracker (a restored tracker state
repeats the mask whatever the default generator did; TP ranks draw their own streams); the
backend is chosen by model.attention_backend / --attention-backend, falls back or refuses
what SDPA cannot serve, and is not structural (a resume may switch it). CP composes:
tests/platform/test_context_parallel.py runs the CP attention on SDPA too."""

import pytest
import torch

from megatron_mvmoe.config.model_section import model_section_from_dict
from megatron_mvmoe.testing.spawn import run_distributed

HEADS, GROUPS, HEAD_DIM, SEQ, BATCH = 4, 2, 8, 12, 2
MLA_QK, MLA_V = 12, 8
"""MLA's query/key heads (qk + RoPE dims) are wider than its value heads."""

CASES = {
    # name: (TransformerConfig overrides, core-attention kwargs, layer number, mask?)
    "causal_gqa_layer_scaling": (dict(apply_query_key_layer_scaling=True), {}, 3, False),
    "mha_softmax_scale": (dict(num_query_groups=HEADS), dict(softmax_scale=0.3), 1, False),
    "given_mask": ({}, {}, 1, True),
    "mla_head_widths": (dict(num_query_groups=HEADS),
                        dict(softmax_scale=MLA_QK ** -0.5, k_channels=MLA_QK,
                             v_channels=MLA_V), 1, False),
}


def _config(tp: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=4, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                  num_query_groups=GROUPS, kv_channels=HEAD_DIM,
                  tensor_model_parallel_size=tp, masked_softmax_fusion=False,
                  attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _inputs(case: str, groups: int, rank: int, tp: int):
    """This TP rank's heads of one fixed full-head q/k/v ([s, b, n, h]) and a mask."""
    qk_dim, v_dim = (MLA_QK, MLA_V) if case.startswith("mla") else (HEAD_DIM, HEAD_DIM)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(SEQ, BATCH, HEADS, qk_dim, generator=gen)
    k = torch.randn(SEQ, BATCH, groups, qk_dim, generator=gen)
    v = torch.randn(SEQ, BATCH, groups, v_dim, generator=gen)
    heads, kv_heads = HEADS // tp, groups // tp
    q, k, v = (q[:, :, rank * heads:(rank + 1) * heads], k[:, :, rank * kv_heads:
               (rank + 1) * kv_heads], v[:, :, rank * kv_heads:(rank + 1) * kv_heads])
    # True = masked (Megatron's convention): causal plus the last two keys of batch row 1
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).repeat(BATCH, 1, 1, 1)
    mask[1, :, :, -2:] = True
    mask[1, :, -2:, 0] = False  # rows whose keys would all be masked see key 0
    return q, k, v, mask


def _run(core, q, k, v, mask):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = core(q, k, v, mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _compare_rank(rank, world_size):
    """{case: (Megatron's [out, dq, dk, dv], SDPA's)} on this TP rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mvmoe.layers.local_mla import MLADotProductAttention
    from megatron_mvmoe.layers.sdpa_attention import SDPA_OF
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.platform import seed_all

    initialize_layout(ParallelLayout(tp=world_size))
    seed_all(0)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    results = {}
    for case, (overrides, kwargs, layer, masked) in CASES.items():
        config = _config(world_size, **overrides)
        megatron = MLADotProductAttention if "k_channels" in kwargs else DotProductAttention
        q, k, v, mask = _inputs(case, config.num_query_groups, rank, world_size)
        results[case] = [_run(cls(config, layer, AttnMaskType.causal, "self",
                                  pg_collection=pgs, **kwargs), q, k, v,
                              mask if masked else None)
                         for cls in (megatron, SDPA_OF[megatron])]
    results["dropout"] = _dropout_streams(world_size, pgs)
    return results


def _dropout_streams(tp: int, pgs):
    """Dropout-on outputs: (first, again from the same tracker states after the default
    generator moved, whether the forward left the default generator alone)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mvmoe.layers.sdpa_attention import SDPADotProductAttention

    core = SDPADotProductAttention(_config(tp, attention_dropout=0.5), 1, AttnMaskType.causal,
                                   "self", pg_collection=pgs).train()
    q, k, v, _ = _inputs("dropout", GROUPS, 0, tp)  # the same inputs on every rank
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    default_before = torch.get_rng_state()
    first = core(q, k, v, None)
    untouched = torch.equal(torch.get_rng_state(), default_before)
    torch.rand(100)  # the default generator moves; the tracker's stream must not care
    tracker.set_states(states)
    again = core(q, k, v, None)
    return first, again, untouched


@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_equals_megatron_dot_product_attention(tp):
    every_rank = run_distributed(_compare_rank, tp)
    for rank, results in enumerate(every_rank):
        for case in CASES:
            megatron, sdpa = results[case]
            for name, want, got in zip(("out", "dq", "dk", "dv"), megatron, sdpa):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5,
                                           msg=f"TP {tp} rank {rank} {case} {name}")
        first, again, untouched = results["dropout"]
        assert torch.equal(first, again) and untouched, f"TP {tp} rank {rank}"
    if tp == 2:  # the same inputs, each TP rank's own model-parallel stream
        assert not torch.equal(every_rank[0]["dropout"][0], every_rank[1]["dropout"][0])


def _transformer_config(**model):
    from megatron_mvmoe.models.provider import transformer_config

    return transformer_config(model_section_from_dict(dict(preset="tiny_smoe", **model)))


@pytest.mark.parametrize("backend,sdpa", [("auto", True), ("sdpa", True), ("flash", True),
                                          ("fused", True), ("unfused", False),
                                          ("local", False)])
def test_attention_backend_picks_the_core_attention(backend, sdpa):
    from megatron_mvmoe.models.fast_paths import Target, attention_line, choose_fast_paths

    assert _transformer_config(attention_backend=backend).sdpa_attention is sdpa
    line = attention_line(choose_fast_paths(Target(cuda=False, te=False), "smoe",
                                            attention_backend=backend))
    assert line.startswith("attention: sdpa (torch " if sdpa else "attention: unfused (")


def test_what_sdpa_cannot_serve_falls_back_under_auto_and_is_refused_under_sdpa():
    from megatron_mvmoe.models.fast_paths import Target, attention_line, choose_fast_paths

    window = dict(extra=dict(window_size=[4, 0]))
    assert _transformer_config(**window).sdpa_attention is False
    blocker = "window_size=[4, 0]: a sliding window is Megatron's masked softmax only"
    assert attention_line(choose_fast_paths(Target(cuda=False, te=False), "smoe",
                                            sdpa_blocker=blocker)) == (
        f"attention: unfused (Megatron's DotProductAttention; {blocker}: falls back)")
    with pytest.raises(ValueError, match=r"^model\.attention_backend: sdpa cannot serve "
                                         r"window_size=\[4, 0\].*Fix: use --attention-backend "
                                         r"unfused"):
        model_section_from_dict(dict(preset="tiny_smoe", attention_backend="sdpa",
                                     **window)).validate()
    with pytest.raises(ValueError, match=r"model\.attention_backend: sdpa replaces Megatron's "
                                         r"local core attention"):
        choose_fast_paths(Target(cuda=True, te=True), "smoe", attention_backend="sdpa")


MEGATRON_LM_LINE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "32", "--vocab-size", "512", "--swiglu",
                    "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                    "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_attention_backend_flag_and_resume_switch():
    """--attention-backend sets model.attention_backend; an unknown value names the field;
    the field is not structural: a checkpoint of either backend loads in the other, and the
    change is named on resume."""
    from megatron_mvmoe.checkpointing.fingerprint import (changed_on_resume, check_fingerprint,
                                                          model_fingerprint)
    from megatron_mvmoe.config.flags import config_from_args

    from megatron_mvmoe.models.provider import transformer_config

    base = ["--model-preset", "tiny_smoe", "--vocab-size", "512", "--seq-length", "32"]
    unfused = config_from_args(base + ["--attention-backend", "unfused"]).model
    assert unfused.attention_backend == "unfused"
    with pytest.raises(ValueError, match="attention_backend"):
        config_from_args(base + ["--attention-backend", "fast"])
    # A bare Megatron-LM line: its parser's default (auto) -> SDPA without TE.
    bare = config_from_args(MEGATRON_LM_LINE).model
    assert bare.attention_backend == "auto" and transformer_config(bare).sdpa_attention
    auto = config_from_args(base).model
    check_fingerprint(model_fingerprint(unfused), model_fingerprint(auto), "ckpt")
    assert any(line.startswith("attention_backend") for line in changed_on_resume(unfused, auto))


def test_spec_swaps_the_local_core_attention():
    """Standard, MLA and CP > 1 slots get their SDPA forms when sdpa_attention is on."""
    results = run_distributed(_spec_rank, 1)[0]
    assert results == {"off": "DotProductAttention", "on": "SDPADotProductAttention",
                       "mla": "SDPAMLADotProductAttention", "cp2": "CPSDPADotProductAttention"}


def _spec_rank(rank, world_size):
    from megatron_mvmoe.models.specs import build_decoder_block_spec
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    initialize_layout(ParallelLayout())
    mla = dict(extra=dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12,
                          qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                          rope_type="rope"))
    configs = {"off": _transformer_config(attention_backend="unfused"),
               "on": _transformer_config(), "mla": _transformer_config(**mla)}
    cp2 = _transformer_config()
    cp2.context_parallel_size = 2
    configs["cp2"] = cp2
    out = {}
    for name, config in configs.items():
        spec = build_decoder_block_spec(config, use_te=False).layer_specs[0]
        out[name] = spec.submodules.self_attention.submodules.core_attention.__name__
    return out
