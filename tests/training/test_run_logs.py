"""The run directory holds the banner, versions.json (with the git commit) and the resolved
config; every progress line and metrics.jsonl record carries MFU, peak memory and ETA;
wandb writes an offline run."""

import json
import os

import pytest
import yaml

from harness import tiny_run, train

from megatron_mvmoe.training import run_info

pytestmark = pytest.mark.timeout(600)


def test_run_dir_banner_versions_config_and_efficiency_figures(tmp_path, capfd, text_tokens):
    data = text_tokens
    raw = tiny_run(data, train_iters=4)
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=2,
                          wandb_project="mvmoe-test")
    train(raw, 1)
    run = tmp_path / "run"
    banner = (run / "banner.txt").read_text()
    assert "parameters: total" in banner and "peak for MFU" in banner and "commit" in banner
    assert "attention: sdpa (torch " in banner  # the core attention that runs (issue 42)
    assert "fusions: SwiGLU off (CPU: a SwiGLU call of" in banner  # tiny: eager, and why
    info = json.loads((run / "versions.json").read_text())
    assert info["megatron_core"] and info["torch"] and len(info["git"]["commit"]) == 40
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["hidden_size"] == 64 and config["model"]["num_experts"] == 4
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4]
    for r in train_records:
        assert 0 < r["mfu"] < 1 and r["peak_memory_gb"] > 0.05 and r["eta_s"] >= 0
    assert train_records[-1]["eta_s"] == 0
    out = capfd.readouterr().out
    assert "| MFU " in out and "| mem " in out and "| ETA 0:00:00" in out
    assert any(name.startswith("offline-run") for name in os.listdir(run / "wandb" / "wandb"))


def test_mfu_arithmetic_and_measured_peak():
    assert run_info.mfu(1000.0, 6e6, 1e10, 2) == pytest.approx(1000 * 6e6 / 2e10)
    assert run_info.format_duration(3725) == "1:02:05"
    peak = run_info.measured_matmul_peak(size=128, seconds=0.05)
    assert 1e7 < peak < 1e13  # a CPU core does 10 MFLOP/s .. 10 TFLOP/s
