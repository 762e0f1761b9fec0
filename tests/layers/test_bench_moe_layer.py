"""tools/bench_moe_layer.py and its sweep (analysis/layer_bench.py, analysis/scaling_report.py).

- The layers are the trainer's: the preset's section through provider.transformer_config
  (SwiGLU, the shared expert, sigmoid routing) and the decoder block's MoE builder; the
  FLOP count (the variant record's) follows that section (checked against a count by hand).
- One tiny point runs end to end: both expert implementations on the same weights, per-round
  ratio spreads, the fast-path decision printed, CPU-time clock with the peak measured on
  the same clock every round; bad flags fail with one line.
- The sweep keeps the preset's width ratios when the hidden size changes, measures a point
  shared by two axes once, and writes the JSON and both plots.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_mvmoe.analysis import layer_bench as lb
from megatron_mvmoe.analysis import scaling_report as sr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench_moe_layer.py")
TINY = ["--hidden", "64", "--latent", "16", "--experts", "8", "--topk", "2",
        "--expert-ffn", "32", "--shared-ffn", "32", "--routers", "2"]


def _tool(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_variant_configs_are_the_trainers_and_flops_follow_them():
    shape = lb.LayerShape(64, 16, 8, 2, 32, 24, 2)
    sections = {v: lb.variant_section("mvmoe_10b_a1b", shape, v) for v in lb.VARIANTS}
    configs = {v: lb.layer_config(section, False) for v, section in sections.items()}
    for variant, config in configs.items():
        assert config.gated_linear_unit and config.moe_shared_expert_intermediate_size == 24
        assert config.moe_router_score_function == "sigmoid" and config.num_layers == 1
        assert config.moe_variant == variant
    assert configs["latent"].multi_view.num_routers == 1
    assert configs["multi_view"].multi_view.num_views == 2
    D, L, E, k, F, S = 64, 16, 8, 2, 32, 24
    latent = 2 * D * E + 4 * D * L + k * 3 * 2 * L * F + 3 * 2 * D * S
    assert lb.layer_flops_per_token(sections["latent"]) == latent
    assert lb.layer_flops_per_token(sections["multi_router"]) == latent + 2 * D * E
    assert lb.layer_flops_per_token(sections["multi_view"]) == (
        latent + 2 * D * E + 2 * D * L + k * 2 * L * 2)


@pytest.mark.slow
def test_tiny_point_times_both_expert_impls_side_by_side():
    proc = _tool(*TINY, "--tokens", "32", "--repeats", "3", "--clock", "cpu", "--threads", "1",
                 "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["cpu_grouped_experts"]["on"] and out["impl"] == "grouped"
    assert set(out["pairs"]) == {f"{v}/{i}" for v in lb.VARIANTS for i in lb.IMPLS}
    for key, row in out["pairs"].items():
        assert row["seconds"]["min"] <= row["seconds"]["median"] <= row["seconds"]["max"]
        assert ("speedup_vs_sequential" in row) == key.endswith("/grouped")
    for variant, row in out["variants"].items():
        assert row["experts"] == "GroupedMatmulExperts" and row["memory_bytes"] > 0
        assert row["time_ratio"] == out["pairs"][f"{variant}/grouped"]["time_ratio"]["median"]
    # the peak is measured with the run's clock before every timed round
    assert len(out["peak_gflops"]) == 3 and min(out["peak_gflops"]) > 0
    assert out["clock"] == "cpu" and out["threads"] == 1
    assert out["cpu_grouped_experts"]["expert_elements"] == 16 * 32


def test_bad_flags_fail_with_one_line():
    proc = _tool(*TINY[:6], "--topk", "9")
    assert proc.returncode != 0 and "--topk 9 exceeds --experts 8" in proc.stderr
    proc = _tool("--sweep")
    assert proc.returncode != 0 and "--sweep needs --out" in proc.stderr
    proc = _tool("--preset", "nope")
    assert proc.returncode != 0 and "not a preset" in proc.stderr
    proc = _tool("--threads", "0")
    assert proc.returncode != 0 and "--threads must be >= 1, got 0" in proc.stderr


def test_sweep_scales_the_preset_ratios_and_dedups_the_base_point():
    base = lb.LayerShape(2048, 256, 128, 8, 3968, 1024, 2)
    half = sr.scaled_shape(base, "hidden_size", 1024)
    assert (half.latent_size, half.moe_ffn_hidden_size,
            half.moe_shared_expert_intermediate_size) == (128, 1984, 512)
    assert sr.scaled_shape(base, "num_experts", 16).num_experts == 16
    points = sr.sweep_points(base, 1024)
    assert len(points) == sum(len(v) for v in sr.AXES.values())
    calls = []

    def fake_point(args, shape, tokens, pgs, impls):
        calls.append((shape, tokens))
        return _fake_point(shape, tokens)

    class Args:
        preset, sweep_base_tokens, repeats, warmup, dtype = "mvmoe_10b_a1b", 1024, 1, 0, "fp32"
        clock = "cpu"

    partial = []
    out = sr.run_sweep(Args, base, None, fake_point, {"on": True, "why": "test"},
                       on_point=lambda o: partial.append(len(o["rows"])))
    assert len(out["rows"]) == len(points) and partial == list(range(1, len(points) + 1))
    costs = [sr.point_cost(shape, tokens) for shape, tokens in calls]
    assert costs == sorted(costs)  # cheapest first: a cut-short sweep keeps the most axes
    assert [(r["axis"], r["value"]) for r in out["rows"]] == [(p[0], p[1]) for p in points]
    # the base shape at 1024 tokens is on the tokens, experts, top-k and hidden axes
    assert len(calls) == len(points) - 3
    assert "| 4096 | 4096 |" in sr.text(out)
    # real width: 3 layers x (weights + grads) x 4 B of 128 x 3 x 256 x 3968 expert params
    assert sr.point_gib(base) == pytest.approx(24 * (128 * 3 * 256 * 3968 + 3 * 2048 * 1024
                                                     + 2 * 2048 * 256 + 2 * 2048 * 128) / 2 ** 30)
    Args.sweep_max_gib = 3.0
    calls.clear()
    small = sr.run_sweep(Args, base, None, fake_point, {"on": True, "why": "test"})
    assert all(sr.point_gib(shape) <= 3.0 for shape, _ in calls) and calls
    assert len(small["rows"]) + len(small["skipped"]) == len(points)
    assert {"axis": "tokens", "value": 256} in [dict(axis=s["axis"], value=s["value"])
                                               for s in small["skipped"]]


def test_sweep_writes_json_and_plots(tmp_path):
    base = lb.LayerShape(512, 64, 16, 2, 992, 256, 2)
    rows = [{"axis": axis, "value": value, **sr._row(_fake_point(base, 256))}
            for axis, values in sr.AXES.items() for value in values]
    out = {"rows": rows}
    paths = sr.write(out, str(tmp_path / "scaling.json"))
    assert json.loads(open(paths[0]).read())["rows"][0]["axis"] == "tokens"
    page = open(paths[1]).read()
    assert "| 256 | 256 |" in page and "scaling_mv_ratio.png" in page
    assert all(os.path.getsize(p) > 1000 for p in paths[2:])


def _fake_point(shape, tokens):
    """run_point's structure: spreads per "variant/impl" in pairs, medians in variants."""
    s = {"median": 1.0, "min": 0.9, "max": 1.2}
    pair = {"seconds": s, "gflops": s, "peak_fraction": s, "time_ratio": s, "flop_ratio": 1.05}
    variant = dict(pair, time_ratio=1.0, median_s=1.0, memory_bytes=10, memory_ratio=1.0,
                   experts="SequentialMLP")
    return {"tokens": tokens, "shape": lb.dataclasses.asdict(shape), "impl": "built",
            "peak_gflops": [100.0, 110.0], "variants": {v: dict(variant) for v in lb.VARIANTS},
            "pairs": {f"{v}/built": dict(pair) for v in lb.VARIANTS}}
