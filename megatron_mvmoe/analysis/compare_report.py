"""Aggregate seeded training runs into the comparison table: mean ± std of held-out
perplexity per domain, and whether each difference to the reference is inside seed noise.

Design choices:
- Perplexity = exp(held-out mean NLL) per run; mean and sample std (ddof = 1) over seeds.
- "Inside seed noise": |mean_v - mean_ref| <= 2 * sqrt(std_v^2 / n_v + std_ref^2 / n_ref),
  i.e. within two standard errors of the difference (with 3 seeds a t-test would need
  about 4.3 standard errors for 95%, so "outside" is a weak claim; it is stated, not
  hidden). With one seed nothing can be said and the cell says so.
- Paired: seed i of every variant shares the data order (and the seed), so the per-seed
  difference to the reference removes the data-order noise; reported next to the unpaired
  verdict with the same 2-standard-error rule.
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


def final_loss_cell(runs: Sequence[Mapping], last: int = 100) -> Cell:
    """Mean training loss over each run's last `last` steps (the seed's "final 1,000 steps"
    comparison, scaled down), mean ± std over runs."""
    values = [sum(run["losses"][-last:]) / len(run["losses"][-last:]) for run in runs]
    mean, std = mean_std(values)
    return Cell(mean, std, len(values))


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
    header = ["variant", "seeds", *[f"ppl {c}" for c in columns], "train loss, last 100 steps",
              "Δ mean ppl vs reference", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in cells.items():
        ref_name = references.get(name, "")
        if not ref_name:
            verdict = "reference"
        elif ref_name not in cells:
            verdict = f"vs {ref_name}: not run"
        else:
            verdict = (f"vs {ref_name}: " + _verdict(row["mean"], cells[ref_name]["mean"])
                       + "; " + paired_verdict(results[name], results[ref_name]))
        lines.append("| " + " | ".join([
            name, str(row["mean"].n), *[row[c].text() if c in row else "-" for c in columns],
            _loss_text(results[name]), verdict, (notes or {}).get(name, "")]) + " |")
    return "\n".join(lines) + "\n"


def paired_verdict(runs: Sequence[Mapping], ref_runs: Sequence[Mapping]) -> str:
    """Per-seed differences of the mean perplexity (run i of both lists = the same seed,
    hence the same data order): mean ± std, inside noise if |mean| <= 2 std / sqrt(n)."""
    pairs = list(zip(runs, ref_runs))
    if len(pairs) < 2:
        return "paired: 1 seed"
    deltas = [perplexity_cells([a])["mean"].mean - perplexity_cells([b])["mean"].mean
              for a, b in pairs]
    mean, std = mean_std(deltas)
    inside = abs(mean) <= 2.0 * std / math.sqrt(len(deltas))
    return (f"paired Δ {mean:+.2f} ± {std:.2f} "
            f"({'inside' if inside else 'outside'} seed noise)")


def _loss_text(runs: Sequence[Mapping]) -> str:
    cell = final_loss_cell(runs)
    return f"{cell.mean:.4f} ± {cell.std:.4f}"


def _verdict(cell: Cell, ref: Cell) -> str:
    delta = cell.mean - ref.mean
    noise = inside_noise(cell, ref)
    if noise is None:
        return f"{delta:+.2f} (1 seed: noise unknown)"
    return f"{delta:+.2f} ({'inside seed noise' if noise else 'outside seed noise'})"


def loss_curves(results: Mapping[str, Sequence[Mapping]]) -> Dict[str, List[List[float]]]:
    return {name: [run["losses"] for run in runs] for name, runs in results.items() if runs}
