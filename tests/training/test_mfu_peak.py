"""The MFU peak (issue 25 finding 8): a start-up hiccup measured 1.0 GFLOP/s where 102 was
right, and MFU read 490-722%. Measurements are injected as plain callables (the `measure`
parameter), so a slow trial is simulated without touching torch."""

import pytest
import torch

from megatron_mvmoe.training import run_info


def _sequence(*values):
    """A measurement that returns `values` in turn (then repeats the last one)."""
    left = list(values)

    def measure():
        return left.pop(0) if len(left) > 1 else left[0]
    return measure


def test_best_of_trials_survives_one_slow_trial():
    peak = run_info.device_peak_flops(False, _sequence(1.0e9, 102.2e9, 95e9))
    assert peak["flops"] == pytest.approx(102.2e9) and "best of 3" in peak["source"]


def test_implausible_measurement_falls_back_to_the_stated_floor():
    peak = run_info.device_peak_flops(False, _sequence(1.0e9))
    floor = run_info.PLAUSIBLE_FLOPS_PER_CPU_THREAD * torch.get_num_threads()
    assert peak["flops"] == pytest.approx(floor)
    assert "plausible floor" in peak["source"] and "1.0 GFLOP/s" in peak["source"]


def test_mfu_above_100_percent_revises_the_peak_and_says_so():

    eff = run_info.Efficiency.__new__(run_info.Efficiency)
    eff.world_size, eff.train_iters, eff.flops_per_token = 1, 10, 6e6
    eff.use_bf16 = False
    floor = run_info.plausible_floor()
    # start-up: implausible -> floor; later re-measurement: still slow (the floor again)
    eff.measure = _sequence(1.0e9)
    eff.peak = run_info.device_peak_flops(False, eff.measure)
    tokens_per_s = 3 * floor / eff.flops_per_token  # achieves 3x the floor
    figures = eff.figures(tokens_per_s, 0.1, 1)
    assert figures["mfu"] <= 1.0 + 1e-12
    assert "MFU peak revised" in figures["mfu_peak_revised"]
    assert "MFU peak revised" in run_info.Efficiency.text(figures)
    again = eff.figures(tokens_per_s / 2, 0.1, 2)  # said once, then a plain figure
    assert "mfu_peak_revised" not in again and again["mfu"] == pytest.approx(0.5)


def test_a_good_remeasurement_replaces_a_low_peak():
    eff = run_info.Efficiency.__new__(run_info.Efficiency)
    eff.world_size, eff.train_iters, eff.flops_per_token, eff.use_bf16 = 2, 10, 1e6, False
    eff.peak = {"flops": 10e9, "source": "measured (hiccup)"}
    eff.measure = _sequence(200e9)
    figures = eff.figures(2 * 50e9 / 1e6, 0.1, 1)  # 50 GFLOP/s per rank achieved
    assert figures["mfu"] == pytest.approx(50 / 200)
    assert "200.0 GFLOP/s" in figures["mfu_peak_revised"]
