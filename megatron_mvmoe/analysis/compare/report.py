"""Aggregate seeded training runs into the comparison table: mean ± std of held-out
perplexity per domain, and whether each difference to the reference is inside seed noise.

Design choices:
- Perplexity = exp(held-out mean NLL) per run; mean and sample std (ddof = 1) over seeds.
- "Inside seed noise": |mean_v - mean_ref| <= 2 * sqrt(std_v^2 / n_v + std_ref^2 / n_ref),
  i.e. within two standard errors of the difference (with 3 seeds a t-test would need
  about 4.3 standard errors for 95%, so "outside" is a weak claim; it is stated, not
  hidden). With one seed nothing can be said and the cell says so.
- Paired: seed i of every variant shares the data order (and the seed), so the per-seed
  difference to the reference removes the data-order noise. Runs are paired by their
  `seed` field (list position for runs without one). The paired figure is a t interval
  (stats.paired_difference, 95 %) with the smallest difference the design detects at 80 %
  power; "resolved" means the interval excludes 0.
- Orderings: each (better, worse) pair a paper reports is tested the same way and called
  "appears" (interval below 0), "reversed" (above 0) or "not resolved" (contains 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_mvmoe.analysis.stats import mean_std, paired_difference


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


def _by_seed(runs: Sequence[Mapping]) -> Dict[int, Mapping]:
    return {int(run.get("seed", i + 1)): run for i, run in enumerate(runs)}


def paired_deltas(runs: Sequence[Mapping], ref_runs: Sequence[Mapping]) -> List[float]:
    """Per-seed differences of the mean held-out perplexity (run - reference), over the
    seeds both have."""
    mine, ref = _by_seed(runs), _by_seed(ref_runs)
    return [perplexity_cells([mine[s]])["mean"].mean - perplexity_cells([ref[s]])["mean"].mean
            for s in sorted(set(mine) & set(ref))]


def paired_stats(runs, ref_runs):
    """stats.PairedDifference of the per-seed differences, or None with < 2 pairs."""
    deltas = paired_deltas(runs, ref_runs)
    return paired_difference(deltas) if len(deltas) >= 2 else None


def paired_verdict(runs: Sequence[Mapping], ref_runs: Sequence[Mapping]) -> str:
    """'paired Δ mean [95 % CI], detectable ±x (resolved/unresolved)'."""
    stats = paired_stats(runs, ref_runs)
    if stats is None:
        return "paired: < 2 common seeds"
    state = "unresolved" if stats.verdict() == "unresolved" else "resolved"
    return (f"paired Δ {stats.mean:+.2f} [{stats.low:+.2f}, {stats.high:+.2f}], "
            f"detectable ±{stats.detectable:.2f} ({state})")


SEEN = {"lower": "appears", "higher": "reversed", "unresolved": "not resolved"}


def ordering_rows(results: Mapping[str, Sequence[Mapping]], orderings) -> List[Dict]:
    """One row per (better, worse, evidence): the paired test of better - worse."""
    rows = []
    for better, worse, evidence in orderings:
        row = {"better": better, "worse": worse, "paper": evidence}
        stats = (paired_stats(results[better], results[worse])
                 if results.get(better) and results.get(worse) else None)
        row["seen"] = "not run" if stats is None else SEEN[stats.verdict()]
        row["paired"] = None if stats is None else stats.as_dict()
        rows.append(row)
    return rows


def orderings_table(rows: Sequence[Dict]) -> str:
    header = ["expected (paper)", "paper's evidence", "paired Δ ppl (better - worse)",
              "95 % CI", "smallest detectable |Δ| (80 % power)", "seeds", "here"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        p = row["paired"]
        cells = (["-"] * 4 if p is None else
                 [f"{p['mean']:+.2f}", f"[{p['low']:+.2f}, {p['high']:+.2f}]",
                  f"{p['detectable']:.2f}", str(p["n"])])
        lines.append("| " + " | ".join([f"{row['better']} < {row['worse']}", row["paper"],
                                         *cells, row["seen"]]) + " |")
    return "\n".join(lines) + "\n"


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
    """label -> per-seed loss curves from step 1. A run resumed from a checkpoint (first_step
    > 1) holds only its last segment's losses and is left out of the curves (its held-out
    figures and final-loss column are whole)."""
    curves = {name: [run["losses"] for run in runs if run.get("first_step", 1) == 1]
              for name, runs in results.items()}
    return {name: runs for name, runs in curves.items() if runs}
