"""tools/gpu_check.sh (what a maintainer runs when a GPU is lent) parses, and its --cpu-smoke
mode runs every stage at tiny sizes on CPU: each stage exits 0 and summary.json carries the
10B-A1B layer figures the GPU run reports (time ratio, TFLOP/s, memory per variant), the
attention stage's SDPA kernel and TFLOP/s, and the resume verdict (steps after the
checkpoint bit-identical, loss falling). A stage that fails
says why in one line and the others still run; a spent time budget skips what is left."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_stage(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", SCRIPT, "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary["stages"]) == {"imports", "gpu_tests", "kernels", "layer_10b", "attention",
                                      "fast_paths", "train_tiny", "train_resume",
                                      "resume_check"}
    assert all(s["exit"] == 0 for s in summary["stages"].values())
    layer = summary["layer_10b"]
    assert set(layer) == {"latent", "multi_router", "multi_view"}
    assert all(r["achieved_tflops"] > 0 and r["memory_bytes"] > 0 for r in layer.values())
    # the planner's activation bytes, next to the measure (which counts weights saved too)
    assert all(0 < r["planned_bytes"] for r in layer.values()), layer
    assert summary["mv_over_baseline_time"] == layer["multi_view"]["time_ratio"]
    # which SDPA kernel ran (issue 42 item 5): CPU's flash kernel here
    assert summary["attention"]["sdpa_kernels"] == ["aten::_scaled_dot_product_flash_attention"
                                                    "_for_cpu"]
    assert summary["attention"]["tflops"]["sdpa"] > 0
    resume = summary["resume"]
    assert resume["ok"] and resume["resumed_at"] == 2 and resume["resumed_steps"] == [3, 4]


def test_a_failing_stage_says_why_in_one_line_and_the_budget_skips_the_rest(tmp_path):
    """A Python that cannot import the package: the first stage fails naming the error, the
    next stages still start (and fail) until the budget is spent, which skips the rest."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named megatron' >&2\n"
                    "sleep 1\nexit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake),
               GPU_CHECK_BUDGET_S="13")  # 1 s stages: about 4 run, the rest are skipped
    proc = subprocess.run(["bash", SCRIPT, "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    rows = [line.split("\t") for line in
            (tmp_path / "out" / "stages.tsv").read_text().splitlines()]
    assert rows[0][:2] == ["imports", "1"]
    assert rows[0][3] == "ModuleNotFoundError: No module named megatron"
    assert rows[1][:2] == ["gpu_tests", "1"]  # the next stage ran
    assert rows[-1][1] == "124" and "budget is spent" in rows[-1][3]
    assert proc.stdout.count("[gpu_check] imports: exit 1") == 1


def test_unknown_argument_and_empty_wheelhouse_are_refused_with_the_fix(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    bad = subprocess.run(["bash", SCRIPT, "--cpu-smok"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cpu-smok" in bad.stderr and "Fix:" in bad.stderr
    empty = subprocess.run(["bash", SCRIPT, "--cpu-smoke", "--wheelhouse", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "scripts/wheelhouse.sh" in empty.stderr
