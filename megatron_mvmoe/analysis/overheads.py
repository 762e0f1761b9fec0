"""Parameter overhead of every variant of a model's family against that family's baseline.

Design choices:
- Counts come from `config.model_costs.parameter_counts`, which tests/planning/test_plan.py
  checks against the built models, so an overhead here is what the provider would add.
- Latent family (latent, multi_router, multi_view): the baseline is the single-router latent
  MoE of the same shape; Multi-Router adds (R - 1) routing heads, Multi-View adds those and
  (K - 1) view projections (seed 000 "Efficiency": cost D (d + N) per layer for K = 2).
  R is the model's own R (2 when the model is the latent baseline itself).
- SMoE family (smoe, mh_moe): the baseline is SMoE with the same E, F and k; MH-MoE adds
  its head and merge projections (2 D^2) and its experts and router see D/H, so with the
  same experts it is usually SMALLER. The seed-001 paper instead re-sizes the experts so
  that MH-MoE matches SMoE (tools/parity.py reports that), so no paper figure is set here.
- `paper_percent` is the seed's reported figure (seed 000 gives them for R = K = 2 only);
  `matches_paper` says whether ours is within `PAPER_TOLERANCE_POINTS` percentage points.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from megatron_mvmoe.config.model_costs import parameter_counts
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.variants import VARIANTS, get_variant

PAPER_PERCENT = {"multi_router": 0.06, "multi_view": 0.19}
"""Seed 000, Efficiency: ~0.06 % (Multi-Router) and ~0.19 % (Multi-View) at 10B-A1B, R = 2."""
PAPER_TOLERANCE_POINTS = 0.02
FAMILIES = {family: tuple(name for name, v in VARIANTS.items() if v.family == family)
            for family in ("latent", "smoe")}
"""Baseline first: ("latent", "multi_router", "multi_view") and ("smoe", "mh_moe")."""


def _variant(m: ModelSection, variant: str, heads: int) -> ModelSection:
    """`m` as `variant` with `heads` routing heads / views / sub-tokens (1 for baselines)."""
    counts = get_variant(variant).head_counts(heads)
    return dataclasses.replace(
        m, moe_variant=variant,
        multi_view=dataclasses.replace(m.multi_view, num_routers=counts["num_routers"],
                                       num_views=counts["num_views"]),
        multi_head=dataclasses.replace(m.multi_head, num_heads=counts["num_heads"]))


def _row(total: int, base: int, paper: Optional[float]) -> Dict:
    extra = total - base
    percent = 100.0 * extra / base
    row = {"total": total, "extra": extra, "percent": percent, "paper_percent": paper}
    row["matches_paper"] = (None if paper is None else
                            abs(percent - paper) <= PAPER_TOLERANCE_POINTS + 1e-12)
    return row


def parameter_overheads(m: ModelSection) -> Dict:
    """{'baseline', 'baseline_total', 'variants': {name: row}}; empty variants for dense."""
    if m.variant.family == "latent":
        family, heads = FAMILIES["latent"], max(2, m.multi_view.num_routers,
                                                m.multi_view.num_views)
    elif m.variant.family == "smoe":
        family, heads = FAMILIES["smoe"], max(2, m.multi_head.num_heads)
    else:
        return {"baseline": m.moe_variant, "baseline_total": parameter_counts(m)["total"],
                "variants": {}}
    base = parameter_counts(_variant(m, family[0], heads))["total"]
    rows = {}
    for name in family[1:]:
        paper = PAPER_PERCENT.get(name) if heads == 2 else None
        rows[name] = dict(_row(parameter_counts(_variant(m, name, heads))["total"], base,
                               paper), heads=heads)
    return {"baseline": family[0], "baseline_total": base, "variants": rows}


def overhead_lines(report: Dict) -> list:
    """Human-readable lines of `parameter_overheads`."""
    lines = [f"overheads vs {report['baseline']} ({report['baseline_total'] / 1e9:.3f} B):"]
    for name, row in report["variants"].items():
        paper = ("" if row["paper_percent"] is None else
                 f"; paper (its 10B-A1B) {row['paper_percent']:.2f} %: ours is "
                 f"{'within' if row['matches_paper'] else 'NOT within'} "
                 f"{PAPER_TOLERANCE_POINTS} points")
        lines.append(f"  {name} (R/H = {row['heads']}): {row['extra']:+,} parameters "
                     f"= {row['percent']:+.3f} %{paper}")
    return lines if report["variants"] else []
