"""Loss-curve plots: every curve of a suite keeps its own look, and the file is written."""

import os

import pytest

from megatron_mvmoe.analysis.plots import curve_style, plot_curves


def test_first_thirty_curves_have_distinct_styles():
    # Suite b has 11 variants: with colour alone the 11th reused the 1st's colour.
    styles = [curve_style(i) for i in range(30)]
    assert len(set(styles)) == 30
    assert curve_style(10) != curve_style(0)


def test_plot_curves_writes_a_png_for_eleven_variants(tmp_path):
    pytest.importorskip("matplotlib")
    curves = {f"variant_{i}": [[8.0 - 0.01 * s - 0.1 * i for s in range(40)]] * 2
              for i in range(11)}
    path = plot_curves(curves, str(tmp_path / "loss.png"), "eleven", smooth=5)
    assert os.path.getsize(path) > 0
