"""Aggregate seeded training runs into the comparison table: mean ± std of held-out
perplexity per domain, and whether each difference to the reference is inside seed noise.

Design choices:
- Perplexity = exp(held-out mean NLL) per run; mean and sample std (ddof = 1) over seeds.
- "Inside seed noise": |mean_v - mean_ref| <= 2 * sqrt(std_v^2 / n_v + std_ref^2 / n_ref),
  i.e. within two standard errors of the difference (about a 95% band for a t-like test
  with few seeds it is optimistic; it is stated, not hidden). With one seed nothing can be
  said and the cell says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_mvmoe.analysis.stats import mean_std


@dataclass(frozen=True)
class Cell:
    mean: float
    std: float
    n: int

    def text(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


def perplexity_cells(runs: Sequence[Mapping]) -> Dict[str, Cell]:
    """domain -> Cell over runs, each run {'eval': {domain: loss}}; plus 'mean' over domains."""
    domains = sorted({d for run in runs for d in run["eval"]})
    cells = {}
    for domain in domains:
        values = [math.exp(run["eval"][domain]) for run in runs if domain in run["eval"]]
        mean, std = mean_std(values)
        cells[domain] = Cell(mean, std, len(values))
    per_run_mean = [sum(math.exp(run["eval"][d]) for d in domains) / len(domains)
                    for run in runs]
    mean, std = mean_std(per_run_mean)
    cells["mean"] = Cell(mean, std, len(per_run_mean))
    return cells


def inside_noise(cell: Cell, ref: Cell) -> Optional[bool]:
    """None when either side has a single seed (no noise estimate)."""
    if cell.n < 2 or ref.n < 2:
        return None
    return abs(cell.mean - ref.mean) <= 2.0 * math.sqrt(cell.std ** 2 / cell.n +
                                                        ref.std ** 2 / ref.n)


def markdown_table(results: Mapping[str, Sequence[Mapping]], references: Mapping[str, str],
                   notes: Mapping[str, str] = None) -> str:
    """Rows = variants (in the given order), columns = domains + mean over domains.

    references: variant -> the variant it is compared with ('' or missing = a reference).
    """
    cells = {name: perplexity_cells(runs) for name, runs in results.items() if runs}
    if not cells:
        return "(no finished runs)\n"
    columns = list(next(iter(cells.values())))
    header = ["variant", "seeds", *[f"ppl {c}" for c in columns], "Δ mean ppl vs reference",
              "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in cells.items():
        ref_name = references.get(name, "")
        if not ref_name:
            verdict = "reference"
        elif ref_name not in cells:
            verdict = f"vs {ref_name}: not run"
        else:
            verdict = f"vs {ref_name}: " + _verdict(row["mean"], cells[ref_name]["mean"])
        lines.append("| " + " | ".join([
            name, str(row["mean"].n), *[row[c].text() if c in row else "-" for c in columns],
            verdict, (notes or {}).get(name, "")]) + " |")
    return "\n".join(lines) + "\n"


def _verdict(cell: Cell, ref: Cell) -> str:
    delta = cell.mean - ref.mean
    noise = inside_noise(cell, ref)
    if noise is None:
        return f"{delta:+.2f} (1 seed: noise unknown)"
    return f"{delta:+.2f} ({'inside seed noise' if noise else 'outside seed noise'})"


def loss_curves(results: Mapping[str, Sequence[Mapping]]) -> Dict[str, List[List[float]]]:
    return {name: [run["losses"] for run in runs] for name, runs in results.items() if runs}
