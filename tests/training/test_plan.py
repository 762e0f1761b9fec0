"""Planner: the 10B-A1B preset lands in its budget, the analytic parameter count equals
the built tiny models exactly (every variant), and the meta-device dry run agrees."""

import subprocess
import sys

import pytest

from megatron_mvmoe.analysis.plan import Layout, parameter_counts, plan
from megatron_mvmoe.models.presets import resolve_model
from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.training.config import ModelSection

TINY = ["tiny_dense", "tiny_smoe", "tiny_latent", "tiny_multi_router", "tiny_multi_view",
        "tiny_mh_moe"]


def test_10b_a1b_budget():
    counts = parameter_counts(resolve_model(ModelSection(preset="mvmoe_10b_a1b")))
    assert 9.5e9 <= counts["total"] <= 10.5e9
    assert 0.9e9 <= counts["active"] <= 1.3e9


def test_memory_shrinks_with_more_gpus():
    m = resolve_model(ModelSection(preset="mvmoe_10b_a1b"))
    small = plan(m, Layout(ep=8, world_size=8))["memory_bytes_per_gpu"]["total"]
    big = plan(m, Layout(tp=2, pp=2, ep=16, world_size=64))["memory_bytes_per_gpu"]["total"]
    assert big < small


def _built_counts(rank, world_size, presets):
    from megatron_mvmoe.models.provider import (build_model_chunks, count_parameters,
                                                transformer_config)
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    pgs = initialize_layout(ParallelLayout())
    out = {}
    for name in presets:
        shape = resolve_model(ModelSection(preset=name))
        out[name] = count_parameters(build_model_chunks(transformer_config(shape), shape, pgs))
    return out


def test_tiny_counts_match_built_models():
    built = run_distributed(_built_counts, 1, timeout_s=240, args=(TINY,))[0]
    for name in TINY:
        planned = parameter_counts(resolve_model(ModelSection(preset=name)))["total"]
        assert planned == built[name], name


@pytest.mark.timeout(240)
def test_dry_run_10b_rank0_matches_plan():
    code = ("from megatron_mvmoe.analysis.plan import Layout, dry_run_build;"
            "from megatron_mvmoe.models.presets import resolve_model;"
            "from megatron_mvmoe.training.config import ModelSection;"
            "m = resolve_model(ModelSection(preset='mvmoe_10b_a1b'));"
            "print('COUNT', dry_run_build(m, Layout(ep=8, world_size=8))['rank0_parameters'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    count = int(out.stdout.split("COUNT")[1].split()[0])
    c = parameter_counts(resolve_model(ModelSection(preset="mvmoe_10b_a1b")))
    assert count == c["total"] - c["experts"] + c["experts"] // 8
