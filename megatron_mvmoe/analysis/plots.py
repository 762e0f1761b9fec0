"""PNG figures for the analysis tools (matplotlib, Agg backend: no display needed).

Each function takes the tools' JSON-ready dicts, writes one PNG and returns its path.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Sequence, Tuple


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ensure_dir(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def plot_alignment(reports: Mapping[str, dict], path: str, title: str) -> str:
    """Per-layer mean per-token rho with CI bars, one series per model (Figure 2 style).

    Args:
        reports: label -> AlignmentReport.as_dict().
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    count = max(len(reports), 1)
    for index, (label, report) in enumerate(reports.items()):
        layers = [entry["layer"] for entry in report["layers"]]
        est = [entry["per_token"]["estimate"] for entry in report["layers"]]
        low = [e - entry["per_token"]["low"] for e, entry in zip(est, report["layers"])]
        high = [entry["per_token"]["high"] - e for e, entry in zip(est, report["layers"])]
        offset = (index - (count - 1) / 2) * 0.12
        glob = report["global"]["estimate"]
        ax.errorbar([x + offset for x in layers], est, yerr=[low, high], marker="o",
                    capsize=3, label=f"{label} (global {glob:.3f})")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean per-token Spearman rho")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_bars(values: Mapping[str, Mapping[str, float]], path: str, title: str,
              ylabel: str) -> str:
    """Grouped bars: group -> {series: value} (e.g. policy -> {domain: ΔNLL})."""
    plt = _pyplot()
    groups = list(values)
    series: List[str] = sorted({s for g in groups for s in values[g]})
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(len(series), 1)
    for index, name in enumerate(series):
        xs = [g + index * width for g in range(len(groups))]
        ax.bar(xs, [values[g].get(name, 0.0) for g in groups], width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    fig.tight_layout()
    _ensure_dir(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


_LINE_STYLES = ("-", "--", ":")


def curve_style(index: int) -> Tuple[str, str]:
    """(colour, line style) of the index-th curve: matplotlib's default cycle has 10
    colours and suite b has 11 variants, so each pass through the colours changes the line
    style; the first 30 curves are all distinguishable."""
    return f"C{index % 10}", _LINE_STYLES[index // 10 % len(_LINE_STYLES)]


def plot_curves(curves: Mapping[str, Sequence[Sequence[float]]], path: str, title: str,
                ylabel: str = "training loss", smooth: int = 1) -> str:
    """Mean curve per label with a min-max band over seeds: label -> [seed][step] values;
    each run is first smoothed by a trailing moving average of `smooth` steps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for index, (label, runs) in enumerate(curves.items()):
        runs = [moving_average(list(r), max(smooth, 1)) for r in runs]
        length = min(len(r) for r in runs)
        if length == 0:
            continue
        cols = [[r[i] for r in runs] for i in range(length)]
        mean = [sum(c) / len(c) for c in cols]
        steps = list(range(1, length + 1))
        color, linestyle = curve_style(index)
        ax.plot(steps, mean, label=label, linewidth=1.2, color=color, linestyle=linestyle)
        ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols],
                        color=color, alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel if smooth <= 1 else f"{ylabel} ({smooth}-step moving average)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_link_bytes(panels: Mapping[str, Sequence[Dict]], path: str, title: str,
                    columns: int = 3) -> str:
    """Stacked intra-node / inter-node bytes: panel title -> rows of {'label', 'intra',
    'inter'} (bytes), one bar per row, a grid of panels."""
    plt = _pyplot()
    names = list(panels)
    cols = min(columns, max(len(names), 1))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        entries = panels[name]
        labels = [e["label"] for e in entries]
        intra = [e["intra"] / 1e6 for e in entries]
        inter = [e["inter"] / 1e6 for e in entries]
        ax.bar(labels, intra, label="intra-node (NVLink)", color="#4c72b0")
        ax.bar(labels, inter, bottom=intra, label="inter-node (network)", color="#dd8452")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MB per rank per layer")
        ax.tick_params(axis="x", labelrotation=75, labelsize=6)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)
