"""Fast-path decisions (models/fast_paths.py): on a GPU with TransformerEngine the 10B-A1B
Multi-View model takes grouped GEMM, the fusions, flash attention, overlapped DDP and bf16;
on CPU the local equivalents; every "off" names its reason; the provider builds exactly
the decided config; `tools/plan.py --fast-paths --json` reports the same."""

import json
import os

import pytest

from megatron_mvmoe.models.fast_paths import (Target, choose_fast_paths, config_fields,
                                              ddp_fields, is_on)

GPU = Target(cuda=True, te=True)
CPU = Target(cuda=False, te=False)
GPU_FAST = ("transformer_engine_specs", "grouped_gemm", "flash_attention", "rope_fusion",
            "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
            "gradient_accumulation_fusion", "overlap_grad_reduce", "overlap_param_gather",
            "bf16", "multi_router_triton_kernel")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG_YAML = os.path.join(ROOT, "examples/configs/mvmoe_10b_a1b_64gpu.yaml")
"""One expert's SwiGLU call 4096 x 8 / 128 rows x 3968 = 1015808 elements, its matrix
I x F = 256 x 3968: big enough for the CPU SwiGLU rule to ask whether inductor compiles,
too big for the CPU grouped path."""


def test_gpu_with_te_takes_every_fast_path_for_multi_view():
    paths = choose_fast_paths(GPU, "multi_view")
    assert all(is_on(paths, name) for name in GPU_FAST)
    # the per-row dispatcher and R heads rule out TE's permute fusion and fused router
    assert not is_on(paths, "moe_permute_fusion") and not is_on(paths, "fused_router")
    assert config_fields(paths)["moe_grouped_gemm"] is True
    assert ddp_fields(paths) == {"overlap_grad_reduce": True, "overlap_param_gather": True}


CPU_FAST = ("cpu_grouped_experts", "sdpa_attention")
"""The CPU's own fast paths (torch._grouped_mm runs on CPU in torch 2.13; torch SDPA as the
core attention, issue 42)."""


def test_cpu_runs_the_local_equivalents_and_says_why():
    paths = choose_fast_paths(CPU, "multi_view")
    assert not any(p.on for p in paths if p.name not in CPU_FAST)
    assert all(is_on(paths, name) for name in CPU_FAST)
    assert all(p.why for p in paths)
    assert {k: v for k, v in config_fields(paths).items() if v} == {"cpu_grouped_experts": True,
                                                                    "sdpa_attention": True}


def test_baseline_latent_keeps_te_permute_and_router_fusion():
    paths = choose_fast_paths(GPU, "latent")
    assert is_on(paths, "moe_permute_fusion") and is_on(paths, "fused_router")
    assert not is_on(paths, "multi_router_triton_kernel")


def test_bitnet_and_missing_te_turn_te_paths_off_with_the_reason():
    bitnet = choose_fast_paths(GPU, "multi_view", bitnet=True)
    assert not is_on(bitnet, "grouped_gemm") and is_on(bitnet, "bias_activation_fusion")
    assert "BitNet" in next(p.why for p in bitnet if p.name == "grouped_gemm")
    no_te = choose_fast_paths(Target(cuda=True, te=False), "smoe")
    assert "TransformerEngine not installed" in next(p.why for p in no_te
                                                     if p.name == "flash_attention")


def test_provider_config_follows_the_decisions():
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.provider import transformer_config

    model = model_from_preset("tiny_multi_view")
    config = transformer_config(model, on_cpu=True)
    for name, value in config_fields(choose_fast_paths(CPU, "multi_view")).items():
        assert getattr(config, name) == value, name


def test_plan_tool_fast_paths_json(capsys):
    import plan

    code = plan.main(["--config", BIG_YAML, "--fast-paths", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)["fast_paths"]
    assert all(report["gpu"][name]["on"] for name in GPU_FAST)
    assert not any(p["on"] for name, p in report["cpu"].items() if name not in CPU_FAST)


def _plan_cpu_fast_paths(capsys, *flags, config=BIG_YAML):
    import plan

    code = plan.main(["--config", config, "--fast-paths", "--target", "cpu", "--json",
                      *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out)["fast_paths"]["cpu"]


def test_plan_tool_decides_from_the_models_fields_as_the_provider(capsys, monkeypatch):
    """The 10B-A1B's expert (256 x 3968) is past the CPU grouped path's threshold and its
    SwiGLU call past the fusion's: plan says so, with the provider's reasons (it said the
    grouped path was on and the SwiGLU size unknown, deciding without the model's sizes).
    Without --probe-inductor nothing compiles, and the SwiGLU line says so."""
    from megatron_mvmoe.platform import inductor_probe

    def no_compile():
        raise AssertionError("tools/plan.py compiled without --probe-inductor")
    monkeypatch.setattr(inductor_probe, "inductor_blocker", no_compile)
    cpu = _plan_cpu_fast_paths(capsys)
    assert not cpu["cpu_grouped_experts"]["on"], cpu["cpu_grouped_experts"]
    assert "I x F = 1015808" in cpu["cpu_grouped_experts"]["why"]
    swiglu = cpu["bias_activation_fusion"]
    assert not swiglu["on"] and "--probe-inductor" in swiglu["why"], swiglu


def test_plan_tool_probe_inductor_asks_the_trainers_probe(capsys, monkeypatch):
    """--probe-inductor takes platform/inductor_probe.py's answer, only where the SwiGLU rule
    asks: not for tiny_smoe, whose calls are too small to fuse (stubbed here: a real compile
    in this pytest worker would make its later forked ranks hang; the probe itself is
    tests/layers/test_compiled_fusions.py's)."""
    from megatron_mvmoe.platform import inductor_probe

    def no_compile():
        raise AssertionError("probed for a model too small to fuse")
    monkeypatch.setattr(inductor_probe, "inductor_blocker", no_compile)
    tiny = _plan_cpu_fast_paths(capsys, "--probe-inductor", config="tiny_smoe")
    assert "eager beats" in tiny["bias_activation_fusion"]["why"], tiny
    monkeypatch.setattr(inductor_probe, "inductor_blocker", lambda: "no g++ here")
    swiglu = _plan_cpu_fast_paths(capsys, "--probe-inductor")["bias_activation_fusion"]
    assert not swiglu["on"] and "no g++ here" in swiglu["why"], swiglu
    monkeypatch.setattr(inductor_probe, "inductor_blocker", lambda: "")
    swiglu = _plan_cpu_fast_paths(capsys, "--probe-inductor")["bias_activation_fusion"]
    assert swiglu["on"] and "inductor C++" in swiglu["why"], swiglu


SWITCHES = [("--no-rope-fusion", "rope_fusion", "apply_rope_fusion"),
            ("--no-masked-softmax-fusion", "masked_softmax_fusion", "masked_softmax_fusion"),
            ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias_dropout_fusion"),
            ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion",
             "gradient_accumulation_fusion")]


def _gpu_paths(*line, optimizer=False):
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.provider import model_fast_paths

    run = config_from_args(list(line))
    return model_fast_paths(run.model, GPU, optimizer=run.optimizer if optimizer else None)


@pytest.mark.parametrize("flag,path,field", SWITCHES)
def test_megatron_lms_fusion_switches_turn_the_fusion_off(flag, path, field):
    """On a GPU with TE a preset fuses; Megatron-LM's --no-... switch turns that fusion off
    there and only that one, the why and the banner's fusions line naming the flag. The
    switches were notes claiming the fusion off while the GPU fused anyway."""
    from megatron_mvmoe.models.fast_paths import as_dict, fusions_line

    platform = _gpu_paths("--model-preset", "tiny_smoe")
    off = _gpu_paths("--model-preset", "tiny_smoe", flag)
    assert is_on(platform, path) and config_fields(platform)[field] is True
    why = next(p.why for p in off if p.name == path)
    assert not is_on(off, path) and config_fields(off)[field] is False and flag in why
    assert f"{path} off ({why})" in fusions_line(off)
    assert {k: v for k, v in as_dict(off).items() if k != path} == \
        {k: v for k, v in as_dict(platform).items() if k != path}


FUSION_FIELDS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                 "gradient_accumulation_fusion", "moe_permute_fusion", "moe_router_fusion")


@pytest.mark.parametrize("case", ["bare_moe_line",
                                  "gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel"])
def test_a_megatron_lm_line_fuses_on_a_gpu_what_megatron_lm_fuses(case):
    """Megatron-LM's own parser's fusion fields for a bare line and the GPT-3 line
    (tests/assets/megatron_lm_parity) equal this trainer's decisions for a GPU with TE:
    --moe-permute-fusion / --moe-router-fusion off when not given (their parser default),
    RoPE not fused with learned positions, --no-gradient-accumulation-fusion honoured; with
    the two switches given, TE's permute and router fuse."""
    with open(os.path.join(ROOT, "tests", "assets", "megatron_lm_parity",
                           f"{case}.json")) as fh:
        record = json.load(fh)
    paths = _gpu_paths(*record["line"])
    assert {f: config_fields(paths)[f] for f in FUSION_FIELDS} == \
        {f: record["transformer_config"][f] for f in FUSION_FIELDS}
    assert "without --moe-permute-fusion" in next(p.why for p in paths
                                                  if p.name == "moe_permute_fusion")
    given = _gpu_paths(*record["line"], "--moe-permute-fusion", "--moe-router-fusion")
    assert is_on(given, "moe_permute_fusion") and is_on(given, "fused_router")


@pytest.mark.parametrize("strategy,fused", [("no_shard", False), ("optim", False),
                                            ("optim_grads", True),
                                            ("optim_grads_params", True)])
def test_megatron_fsdp_unsharded_grads_keep_gradient_accumulation_unfused(
        strategy, fused, monkeypatch):
    """Megatron-Core 0.19.2's Megatron-FSDP sets overwrite_main_grad for every strategy: with
    TE's fused weight-gradient GEMM, no_shard and optim would keep only the last
    microbatch's gradient. The GPU decision and the Megatron config the trainer builds
    (models/build.py model_config, TE's config-checked kernels switched off: absent here)
    leave the fusion off there, on for the sharded-gradient strategies."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models import build, provider

    line = ["--model-preset", "tiny_smoe", "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy", strategy]
    paths = _gpu_paths(*line, optimizer=True)
    why = next(p.why for p in paths if p.name == "gradient_accumulation_fusion")
    assert is_on(paths, "gradient_accumulation_fusion") is fused
    assert fused or (strategy in why and "overwrite_main_grad" in why), why
    assert is_on(_gpu_paths(*line), "gradient_accumulation_fusion")  # no optimizer: DDP
    monkeypatch.setattr(provider, "target_for", lambda on_cpu, model=None: GPU)
    run = config_from_args(line + ["--no-rope-fusion"])
    run.model.moe_permute_fusion = False
    assert build.model_config(run).gradient_accumulation_fusion is fused


def test_rope_fusion_only_where_megatron_fuses_that_rope():
    """Megatron-LM's validate_args fuses only --position-embedding-type rope, and
    Megatron-Core's MLA config raises for fused RoPE other than YaRN: on a GPU with TE such
    models build unfused RoPE, saying why (MLATransformerConfig raised for MLA with
    --rope-type rope)."""
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.provider import model_fast_paths

    def rope(**fields):
        paths = model_fast_paths(model_from_preset("tiny_smoe", **fields), GPU)
        return next((p.on, p.why) for p in paths if p.name == "rope_fusion")
    assert rope()[0] and rope(extra={"multi_latent_attention": True})[0]  # MLA: YaRN
    on, why = rope(extra={"multi_latent_attention": True, "rope_type": "rope"})
    assert not on and "--rope-type rope" in why
    on, why = rope(position_embedding_type="yarn")
    assert not on and "--position-embedding-type yarn" in why


def test_every_run_switch_is_a_declared_fusion_switch():
    """The fast paths' switches (RUN_SWITCHES) and the model's (FUSION_SWITCHES, kept out of
    the fingerprint) are one list: a switch added to one only fails here."""
    from megatron_mvmoe.config.model_section import FUSION_SWITCHES
    from megatron_mvmoe.models.fast_paths import RUN_SWITCHES

    assert {field for _, field, _, _ in RUN_SWITCHES} | {"bias_swiglu_fusion"} == \
        set(FUSION_SWITCHES)
