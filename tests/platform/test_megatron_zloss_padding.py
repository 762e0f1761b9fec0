"""Why Megatron-LM's `test_aux_loss.py::TestPaddingMaskAuxLoss::test_padding_mask_with_z_loss`
fails here (examples/results/megatron_moe_tests.md): stock Megatron-Core 0.19.2 fails it
in one CPU process without megatron_mvmoe, and our platform layer changes nothing on that
path. The reproduction is examples/results/megatron_zloss_padding_repro.py, run as a
script (stock means: no megatron_mvmoe import in that process)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "examples" / "results" / "megatron_zloss_padding_repro.py"


def _reproduce(*flags):
    out = subprocess.run([sys.executable, str(REPRO), "--json", *flags], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stock():
    return _reproduce("--tp-cp", "8")


def test_stock_megatron_fails_the_gradient_assert_from_padded_scores(stock):
    """The z-loss assert holds; the gradient assert fails; back-propagating only the valid
    tokens' scores makes it hold: the difference comes from the padded tokens' scores,
    whose exact-arithmetic gradient (p * (1 - sum p)) is a float32 residue."""
    assert not stock["megatron_mvmoe_loaded"]
    assert stock["z_loss_equal"]
    assert not stock["grad_equal"] and stock["grad_entries_differing"] >= 1
    assert stock["grad_equal_backward_valid_rows_only"]
    assert 0 < stock["padded_score_grad_residue"] < 1e-6


def test_our_layer_gives_the_same_outcome_as_stock(stock):
    ours = _reproduce("--tp-cp", "8", "--through-our-layer")
    assert ours.pop("megatron_mvmoe_loaded")
    stock = dict(stock)
    stock.pop("megatron_mvmoe_loaded")
    assert ours == stock
