"""Megatron-Core's compiled SwiGLU on CPU (issue 42): `bias_swiglu_impl` and its weighted
form (torch.compile, inductor C++) equal the naive SwiGLU forward and backward; the CPU rule
(models/fast_paths.py `bias_activation_fusion`) runs it where Megatron-LM's
--bias-swiglu-fusion asks, inductor compiles (platform/inductor_probe.py) and the model is
big enough, and says why not elsewhere; the field is not structural; a resume with the
fusion on is bit-identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_mvmoe.models.fast_paths import (SWIGLU_FUSION_MIN_ELEMENTS, SwigluCalls,
                                              Target, choose_fast_paths, fusions_line)
from megatron_mvmoe.platform.inductor_probe import inductor_blocker

TOL = dict(rtol=1e-5, atol=1e-6)
BASE = ["--model-preset", "tiny_smoe", "--vocab-size", "512"]
BIG_ENOUGH = ["--seq-length", "512", "--moe-ffn-hidden-size", "1024"]
"""One expert's SwiGLU call: 512 x 2 / 4 rows x 1024 = 2^18, the smallest the CPU rule
fuses (tiny_smoe: 4 experts, top-2); the grouped path (I x F = 64 x 1024 <= 2^16) calls it
once on all 512 x 2 rows, 2^20."""


@pytest.fixture(autouse=True)
def _compiles_only_in_child_processes():
    """Every compile of this file (the probe's too) happens in a child process: a pytest
    worker that compiled would fork later tests' ranks (launch/local_ranks.py) sharing
    inductor's compile workers and autograd threads, which hung the resume test in CI."""
    from torch._dynamo.utils import counters

    before = counters["frames"]["ok"]
    yield
    assert counters["frames"]["ok"] == before, "torch.compile ran in the pytest worker"


def _naive_swiglu(y_NG: torch.Tensor) -> torch.Tensor:
    gate_NF, linear_NF = torch.chunk(y_NG, 2, dim=-1)
    return F.silu(gate_NF) * linear_NF


def _value_and_grads(fn, *inputs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape))
    return [out.detach()] + [t.grad for t in leaves]


def _compiled_swiglu_worker(rank, world_size):
    from megatron.core.fusions.fused_bias_swiglu import (bias_swiglu_impl,
                                                         weighted_bias_swiglu_impl)

    assert inductor_blocker() == "", inductor_blocker()
    gen = torch.Generator().manual_seed(0)
    for rows in (7, 7, 300, 301):
        y_NG, probs_N1 = torch.randn(rows, 96, generator=gen), torch.rand(rows, 1, generator=gen)
        got = _value_and_grads(lambda y: bias_swiglu_impl(y, None), y_NG)
        want = _value_and_grads(_naive_swiglu, y_NG)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)
        got = _value_and_grads(lambda y, p: weighted_bias_swiglu_impl(y, None, p), y_NG, probs_N1)
        want = _value_and_grads(lambda y, p: _naive_swiglu(y) * p, y_NG, probs_N1)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)


def test_compiled_swiglu_equals_naive_forward_and_backward():
    """Both of Megatron's fused forms, at a fixed and at changing row counts (the expert
    loop's: dynamo recompiles once with a dynamic size, then reuses it). Compiled in a child
    process: after a compile, this pytest worker's later ranks would have to be spawned
    (local_ranks' fork is unsafe then), slowing every test file after this one."""
    from megatron_mvmoe.testing.spawn import run_distributed

    run_distributed(_compiled_swiglu_worker, 1, timeout_s=300)


def _swiglu_path(target, requested=True, size=SWIGLU_FUSION_MIN_ELEMENTS):
    paths = choose_fast_paths(target, "smoe", swiglu_fusion=requested,
                              swiglu_size=None if size is None else SwigluCalls(size, size))
    return next(p for p in paths if p.name == "bias_activation_fusion"), fusions_line(paths)


def test_cpu_rule_fuses_where_asked_compilable_and_big_enough():
    cpu = Target(cuda=False, te=False, inductor_blocker="")
    on, line = _swiglu_path(cpu)
    assert on.on and on.fields == {"bias_activation_fusion": True} and "inductor" in line
    small, _ = _swiglu_path(cpu, size=SWIGLU_FUSION_MIN_ELEMENTS - 1)
    assert not small.on and "eager beats" in small.why
    broken, _ = _swiglu_path(Target(cuda=False, te=False, inductor_blocker="no g++"))
    assert not broken.on and "no g++" in broken.why
    asked_off, line = _swiglu_path(Target(cuda=True, te=True), requested=False)
    assert not asked_off.on and "--no-bias-swiglu-fusion" in line
    gpu, _ = _swiglu_path(Target(cuda=True, te=False), size=None)
    assert gpu.on and "Triton" in gpu.why


def _naive_swiglu_rows(m, etp=1):
    """(one expert's rows, all experts' rows) x F / etp of one sequence: every (sub-token,
    slot) row dealt to the experts in turn, counted one by one."""
    from collections import Counter

    heads = m.multi_head.num_heads if m.moe_variant == "mh_moe" else 1
    k, e = m.moe_router_topk, m.num_experts
    per_expert = Counter((row % e) for row in range(m.seq_length * heads * k))
    width = m.moe_ffn_hidden_size // etp
    return per_expert[0] * width, sum(per_expert.values()) * width


def test_swiglu_call_sizes_equal_a_naive_count():
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.fast_paths import swiglu_calls

    for preset in ("tiny_smoe", "tiny_multi_view", "tiny_mh_moe", "tiny_dense"):
        m = model_from_preset(preset)
        calls = swiglu_calls(m)
        if not m.is_moe:
            assert calls == SwigluCalls(*[m.seq_length * m.ffn_hidden_size] * 2)
            continue
        assert (calls.sequential, calls.grouped) == _naive_swiglu_rows(m), preset
        one_expert_etp2 = _naive_swiglu_rows(m, etp=2)[0]  # grouped falls back at ETP 2
        assert swiglu_calls(m, etp=2) == SwigluCalls(one_expert_etp2, one_expert_etp2)


def test_the_threshold_reads_the_call_the_expert_path_makes():
    """seq 2048 of tiny_smoe (4 experts, top-2, F 64): one expert's call 2^16, the grouped
    path's one call over all experts 2^18. Grouped (I x F = 64 x 64): fused; under BitNet
    (SequentialMLP's loop): eager, for its 2^16-element calls."""
    import dataclasses

    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.provider import model_fast_paths

    m = model_from_preset("tiny_smoe", seq_length=2048)
    cpu = Target(cuda=False, te=False, inductor_blocker="")
    paths = {p.name: p for p in model_fast_paths(m, cpu)}
    assert paths["cpu_grouped_experts"].on and paths["bias_activation_fusion"].on, paths
    bitnet = dataclasses.replace(m, bitnet=dataclasses.replace(m.bitnet, enabled=True))
    paths = {p.name: p for p in model_fast_paths(bitnet, cpu)}
    swiglu = paths["bias_activation_fusion"]
    assert not paths["cpu_grouped_experts"].on and not swiglu.on
    assert f"a SwiGLU call of {2048 * 2 // 4 * 64} elements" in swiglu.why, swiglu


def _flag_default_worker(rank, world_size):
    from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint, model_fingerprint
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.provider import transformer_config

    tiny = config_from_args(BASE + ["--seq-length", "32"]).model
    assert tiny.bias_swiglu_fusion and not transformer_config(tiny).bias_activation_fusion
    big = config_from_args(BASE + BIG_ENOUGH).model
    assert transformer_config(big).bias_activation_fusion  # the inductor probe compiles
    off = config_from_args(BASE + BIG_ENOUGH + ["--no-bias-swiglu-fusion"]).model
    assert not off.bias_swiglu_fusion and not transformer_config(off).bias_activation_fusion
    check_fingerprint(model_fingerprint(off), model_fingerprint(big), "ckpt")


def test_flag_default_and_not_structural():
    """--no-bias-swiglu-fusion sets the field; the default fuses a big-enough CPU model and
    leaves tiny ones eager (they never compile); a checkpoint loads across the switch. In a
    child process: deciding for the big model runs the inductor probe, a compile."""
    from megatron_mvmoe.testing.spawn import run_distributed

    run_distributed(_flag_default_worker, 1, timeout_s=300)


@pytest.mark.slow
def test_resume_with_fused_swiglu_is_bit_identical(text_tokens, tmp_path):
    """A run on the fused path (the same rule the provider applies) stopped at step 2 and
    resumed continues with the uninterrupted run's losses, bit for bit."""
    from harness import tiny_run, train

    def raw(**training):
        run = tiny_run(text_tokens, preset="tiny_smoe", eval_iters=0, global_batch_size=2,
                       micro_batch_size=1, **training)
        run["model"].update(seq_length=512, moe_ffn_hidden_size=1024)
        return run
    root = str(tmp_path / "ck")
    full = train(raw(train_iters=4, save=root, save_interval=2), 1)
    with open(f"{root}/latest", "w") as fh:
        fh.write("iter_0000002\n")
    resumed = train(raw(train_iters=4, load=root), 1)
    assert resumed["first_step"] == 3 and resumed["losses"] == full["losses"][2:]


def test_a_model_without_swiglu_has_none_to_fuse():
    """GeLU MLPs (Megatron-LM without --swiglu): the banner's fusions line says the model has
    no SwiGLU, on CPU as on a GPU, where the provider builds no fused SwiGLU either."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.training.build import run_fast_paths

    run = config_from_args(BASE + BIG_ENOUGH)
    run.model.swiglu = False
    line = fusions_line(run_fast_paths(run))
    assert line.startswith("fusions: SwiGLU off (the model's MLPs are not SwiGLU"), line
    from megatron_mvmoe.models.provider import model_fast_paths

    gpu = fusions_line(model_fast_paths(run.model, Target(cuda=True, te=True)))
    assert gpu.startswith("fusions: SwiGLU off (the model's MLPs are not SwiGLU"), gpu
