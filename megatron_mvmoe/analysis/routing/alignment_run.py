"""Run the score-utility alignment analysis on a model: dense evaluation of every expert at
every MoE layer, both utilities, per-layer and global Spearman (analysis/routing/alignment.py).

Legend: T tokens (flattened [S, B] order), E experts, L expert width, D hidden size.

Design choices:
- One unmodified forward per batch records each MoE layer's input (forward pre-hooks);
  routing and dense expert outputs are recomputed from it with the layer's own modules
  (analysis/routing/probe.py), so nothing inside the model is changed for the norm utility.
- The loss-change utility toggles expert i at ONE layer for EVERY token of the batch at
  once (one extra forward per (layer, expert)): E forwards per layer instead of T * E.
  A token's NLL change therefore also includes what the toggle did to earlier positions
  through attention; with a single MoE block (or the last one) it is the token's own.
- Tokens of all batches are concatenated per layer, in the same order at every layer, so
  the global bootstrap resamples tokens jointly across layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_mvmoe.analysis.routing import probe as moe_probe
from megatron_mvmoe.analysis.routing.alignment import (
    AlignmentReport, alignment_report, forced_loss_utility, normalised_output_norm)

NllFn = Callable[[torch.nn.Module, object], torch.Tensor]
"""(model, batch) -> per-token NLL [T] in the MoE layers' token order ([S, B] flattened)."""


@dataclass
class AlignmentData:
    """Per-layer tables gathered from a model (tokens of all batches concatenated)."""

    scores: Dict[int, List[torch.Tensor]] = field(default_factory=dict)
    norm_utility: Dict[int, List[torch.Tensor]] = field(default_factory=dict)
    loss_utility: Dict[int, List[torch.Tensor]] = field(default_factory=dict)

    def stacked(self, table: Dict[int, List[torch.Tensor]]) -> Dict[int, torch.Tensor]:
        return {layer: torch.cat(chunks) for layer, chunks in table.items()}


@torch.no_grad()
def collect(model: torch.nn.Module, batches: Sequence[object], nll_fn: NllFn,
            loss_utility: bool = False, layers: Optional[Sequence[int]] = None,
            progress: Optional[Callable[[str], None]] = None) -> AlignmentData:
    """Router scores and utilities of every (selected) MoE layer for every batch;
    `progress` (if given) hears one line per batch."""
    found = moe_probe.moe_layers(model)
    chosen = {k: found[k] for k in (layers or sorted(found))}
    was_training = model.training
    model.eval()
    data = AlignmentData()
    try:
        for number, batch in enumerate(batches, start=1):
            if progress is not None:
                progress(f"batch {number}/{len(batches)}: scores and utilities of "
                         f"{len(chosen)} MoE layers")
            with moe_probe.capture_inputs(chosen) as inputs:
                nll_base_T = nll_fn(model, batch)
            for key, layer in chosen.items():
                _collect_layer(model, batch, nll_fn, key, layer, inputs[key], nll_base_T,
                               loss_utility, data)
    finally:
        model.train(was_training)
    return data


def _collect_layer(model, batch, nll_fn, key, layer, hidden, nll_base_T, loss_utility, data):
    probe = moe_probe.probe_routing(layer, hidden)
    outputs_TEL = moe_probe.dense_expert_outputs(
        layer, moe_probe.expert_inputs(layer, hidden, probe))
    data.scores.setdefault(key, []).append(probe.summed_TE.double())
    data.norm_utility.setdefault(key, []).append(normalised_output_norm(outputs_TEL))
    if not loss_utility:
        return
    toggled = []
    for expert in range(outputs_TEL.shape[1]):
        delta_TD = moe_probe.toggle_delta(layer, probe, outputs_TEL, expert)
        with moe_probe.add_to_output(layer, delta_TD):
            toggled.append(nll_fn(model, batch))
    util_TE = forced_loss_utility(nll_base_T, torch.stack(toggled, dim=1), probe.topk_idx_TS)
    data.loss_utility.setdefault(key, []).append(util_TE)


def reports(data: AlignmentData, resamples: int = 1000, level: float = 0.95,
            seed: int = 0) -> Dict[str, AlignmentReport]:
    """{'norm': report, 'loss': report (when collected)}."""
    scores = data.stacked(data.scores)
    out = {"norm": alignment_report(scores, data.stacked(data.norm_utility), resamples, level,
                                    seed)}
    if data.loss_utility:
        out["loss"] = alignment_report(scores, data.stacked(data.loss_utility), resamples,
                                       level, seed)
    return out
