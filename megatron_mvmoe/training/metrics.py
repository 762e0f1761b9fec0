"""Routing metrics per MoE layer, and the run's log sinks (console, JSONL, TensorBoard).

Legend: E experts.

Design choices:
- Tokens per expert are read where they are certain for every variant: a forward
  pre-hook on each MoE layer's `experts` module sees Megatron's `tokens_per_expert` for the
  local experts after dispatch (training forwards only). Counts accumulate locally and are
  reduced only at log time: scattered into a global counts_E, summed over the expert-parallel
  group (disjoint experts) and the expert-data-parallel group (disjoint tokens), divided by
  the expert-TP size (ETP ranks see the same tokens), then gathered over the pipeline.
- Aux losses come from Megatron 0.19.2's `MoEMetricsTracker` (what its routers and ours
  record), reduced by its own `report()` (PP sum, each metric's reduce/avg group, DP mean,
  x 1/micro-batches). A subclass installed through Megatron's `set_moe_metrics_tracker`
  seam keeps the reduced per-layer values of the last report, which metrics.jsonl logs.
- MoE layers inside MTP layers are numbered as Megatron's tracker numbers them (after the
  decoder layers), so their token counts never merge into a decoder layer's.
- MTP losses come from Megatron's `MTPLossLoggingHelper` (recorded on the last stage per
  training micro-batch), reduced at log time like the aux losses.
- Only global rank 0 writes; every rank takes part in the reductions, over the groups of
  the run's `pg_collection` (Megatron's ProcessGroupCollection), passed in: nothing here
  reads `parallel_state`.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import (MoEMetricsTracker,
                                                       get_moe_metrics_tracker,
                                                       set_moe_metrics_tracker)

from megatron_mvmoe import platform


class RoutingMonitor:
    """Counts tokens per expert for every MoE layer on this rank; reduces them over the
    groups of `pg_collection`."""

    def __init__(self, chunks: List[torch.nn.Module], num_experts: int, pg_collection) -> None:
        self.num_experts, self.pgs = num_experts, pg_collection
        self.layers: Dict[int, MoELayer] = {}
        self.counts: Dict[int, torch.Tensor] = {}
        self.handles = []
        self.heads: Dict[int, torch.Tensor] = {}
        self.head_views: Dict[int, bool] = {}
        self.observed_routers = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, MoELayer):
                    self._watch(module)

    def _watch(self, layer: MoELayer) -> None:
        number = tracker_layer_number(layer)
        self.layers[number] = layer
        self.counts[number] = torch.zeros(self.num_experts, dtype=torch.float64)
        indices = torch.tensor(layer.local_expert_indices)

        def count(module, args):
            if module.training and torch.is_grad_enabled():
                local = args[1].detach().to("cpu", torch.float64)
                self.counts[number].index_add_(0, indices, local)

        self.handles.append(layer.experts.register_forward_pre_hook(count))
        router = getattr(layer, "router", None)
        if getattr(router, "num_routers", 1) > 1 and hasattr(router, "observers"):
            self._watch_heads(number, router)

    def _watch_heads(self, number: int, router) -> None:
        """Router diversity while training: mean inter-head Spearman over experts and the
        normalised entropy of the view blends, accumulated per routed microbatch."""
        from megatron_mvmoe.functional.diversity import head_rank_correlation, mixing_entropy

        self.heads[number] = torch.zeros(3, dtype=torch.float64)  # corr, entropy, batches
        self.head_views[number] = router.num_views > 1

        def observe(routing) -> None:
            if not (router.training and torch.is_grad_enabled()):
                return
            if not torch.isfinite(routing.scores_TRE).all():
                return  # a non-finite step is the NaN watch's to report, not the metrics'
            with torch.no_grad():
                pairs = head_rank_correlation(routing.scores_TRE.detach().float())
                corr = sum(pairs.values()) / max(1, len(pairs))
                entropy = (mixing_entropy(routing.mix_TSR.detach())
                           if routing.mix_TSR is not None else 0.0)
                self.heads[number] += torch.tensor([corr, entropy, 1.0], dtype=torch.float64)

        router.observers.append(observe)
        self.observed_routers.append((router, observe))

    def reduce_diversity(self) -> Dict[int, Dict[str, float]]:
        """Per layer: mean inter-head rank correlation and mixing entropy since the last call,
        averaged over data-parallel ranks and gathered over the pipeline (collective)."""
        mine = {}
        for number, sums in sorted(self.heads.items()):
            total = sums.clone()
            dist.all_reduce(total, group=self.pgs.dp)
            batches = max(1.0, float(total[2]))
            mine[number] = {"head_rank_correlation": float(total[0]) / batches}
            if self.head_views[number]:
                mine[number]["mixing_entropy"] = float(total[1]) / batches
            sums.zero_()
        return _merge_over_pipeline(mine, self.pgs.pp)

    def reduce(self) -> Dict[int, List[float]]:
        """Global tokens per expert per layer since the last call (collective)."""
        mine = {}
        etp = self.pgs.expt_tp.size()
        for number, counts in sorted(self.counts.items()):
            total = counts.clone()
            dist.all_reduce(total, group=self.pgs.ep)
            dist.all_reduce(total, group=self.pgs.expt_dp)
            mine[number] = (total / etp).tolist()
            counts.zero_()
        return _merge_over_pipeline(mine, self.pgs.pp)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for router, observe in self.observed_routers:
            router.observers.remove(observe)


def tracker_layer_number(layer: MoELayer) -> int:
    """The layer's slot in Megatron's MoE metrics tracker: decoder layers 1..num_layers, then
    the MTP layers (whose inner layers are numbered 1, 2, ... again) after them."""
    number = int(layer.layer_number)
    if getattr(layer, "is_mtp_layer", False):
        number += layer.config.num_layers
    return number


def mtp_losses(num_microbatch_steps: int, config, pg_collection) -> Dict[str, float]:
    """Per MTP layer: the mean MTP loss per micro-batch since the last call (what Megatron's
    `MTPLossLoggingHelper` recorded on the last stage), averaged over the data-parallel
    ranks, and its next-token acceptance rate (%), both broadcast over the pipeline group;
    the tracker is then cleared (Megatron's own clean). Collective; {} without MTP."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    layers = config.mtp_num_layers or 0
    if not layers:
        return {}
    tracker = MTPLossLoggingHelper.tracker
    values = torch.zeros(3, layers, dtype=torch.float64, device=platform.device())
    for row, key in enumerate(("loss_values", "correct_values", "total_values")):
        if key in tracker:  # loss, correct, total
            values[row] = tracker[key].detach().to(values.device, torch.float64)
    dist.all_reduce(values, group=pg_collection.dp_cp)
    values[0] /= pg_collection.dp_cp.size() * max(1, num_microbatch_steps)
    dist.all_reduce(values, group=pg_collection.pp)
    values = values.cpu()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    out = {}
    for i in range(layers):
        out[f"mtp_{i + 1}_loss"] = float(values[0, i])
        out[f"mtp_{i + 1}_acceptance_rate"] = float(100 * values[1, i] / values[2, i].clamp(min=1))
    return out


def _merge_over_pipeline(mine: Dict, pp_group: dist.ProcessGroup) -> Dict:
    """Every pipeline stage's per-layer entries, merged (collective over `pp_group`)."""
    gathered: List[Optional[dict]] = [None] * pp_group.size()
    dist.all_gather_object(gathered, mine, group=pp_group)
    merged: Dict = {}
    for part in gathered:
        merged.update(part or {})
    return merged


class PerLayerMoEMetricsTracker(MoEMetricsTracker):
    """Megatron's tracker, also keeping the reduced per-layer values of its last report
    (`report()` syncs them in place, then clears)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_per_layer: Dict[str, List[float]] = {}
        self._loss_scale: Optional[float] = None

    def report(self, loss_scale: float, iteration: int, **kwargs) -> str:
        self._loss_scale = loss_scale
        try:
            return super().report(loss_scale, iteration, **kwargs)
        finally:
            self._loss_scale = None

    def clear(self) -> None:
        if self._loss_scale is not None:  # inside report: values are reduced, not yet zeroed
            self.last_per_layer = {name: (entry.values.double() * self._loss_scale).tolist()
                                   for name, entry in sorted(self.metrics.items())}
        super().clear()


def install_moe_metrics_tracker() -> PerLayerMoEMetricsTracker:
    """Make Megatron's routers record into a PerLayerMoEMetricsTracker (idempotent)."""
    tracker = get_moe_metrics_tracker()
    if not isinstance(tracker, PerLayerMoEMetricsTracker):
        tracker = PerLayerMoEMetricsTracker()
        set_moe_metrics_tracker(tracker)
    return tracker


def aux_losses(num_microbatch_steps: int, config, pg_collection) -> Dict[str, List[float]]:
    """Per-layer aux/z losses, reduced by Megatron's tracker over the groups of
    `pg_collection` and averaged per micro-batch (collective). Stages without MoE layers
    still join the reductions (force_initialize)."""
    tracker = install_moe_metrics_tracker()
    names = sorted(_merge_over_pipeline({name: None for name in tracker.metrics},
                                        pg_collection.pp))
    tracker.report(loss_scale=1.0 / max(1, num_microbatch_steps), iteration=0,
                   force_initialize=True, track_names=names, num_layers=config.num_layers,
                   moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers,
                   pg_collection=pg_collection)
    return dict(tracker.last_per_layer)


def routing_summary(counts: Dict[int, List[float]], aux: Dict[str, List[float]],
                    diversity: Optional[Dict[int, Dict[str, float]]] = None) -> Dict:
    """Per layer: tokens per expert, load max/mean and coefficient of variation, every aux
    loss recorded, and (multi-head routers) inter-head rank correlation and mixing entropy."""
    layers = {}
    for number, per_expert in sorted(counts.items()):
        tokens = torch.tensor(per_expert, dtype=torch.float64)
        mean = float(tokens.mean()) if tokens.numel() else 0.0
        entry = {"tokens_per_expert": [int(x) for x in per_expert],
                 "load_max_over_mean": float(tokens.max()) / mean if mean > 0 else 0.0,
                 "load_cv": float(tokens.std(unbiased=False)) / mean if mean > 0 else 0.0}
        entry.update((diversity or {}).get(number, {}))
        for name, values in aux.items():
            if number - 1 < len(values):
                entry[name] = values[number - 1]
        layers[str(number)] = entry
    return layers


class RunLog:
    """JSONL + TensorBoard + console lines, written by global rank 0 only."""

    def __init__(self, run_dir: Optional[str], tensorboard: bool, is_writer: bool,
                 tensorboard_dir: Optional[str] = None, wandb=None) -> None:
        self.is_writer = is_writer and run_dir is not None
        self.console = is_writer
        self.jsonl = None
        self.tb = None
        self.wandb = _start_wandb(wandb, run_dir) if is_writer and wandb is not None else None
        if self.is_writer:
            os.makedirs(run_dir, exist_ok=True)
            self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        tb_dir = tensorboard_dir or (os.path.join(run_dir, "tensorboard") if run_dir else None)
        if is_writer and tensorboard and tb_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tb_dir)

    def record(self, kind: str, step: int, values: Dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            self._scalars(f"{kind}/", step, values)
        if self.wandb is not None:
            self.wandb.log(_flat(f"{kind}/", values), step=step)

    def _scalars(self, prefix: str, step: int, values: Dict) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(prefix + key, value, step)
            elif isinstance(value, dict):
                self._scalars(f"{prefix}{key}/", step, value)

    def line(self, text: str) -> None:
        if self.console:
            print(text, flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _flat(prefix: str, values: Dict) -> Dict[str, float]:
    out = {}
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = value
        elif isinstance(value, dict):
            out.update(_flat(f"{prefix}{key}/", value))
    return out


def _start_wandb(logging_section, run_dir: Optional[str]):
    """A Weights & Biases run in offline mode (sync later with `wandb sync`)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("logging.wandb_project: wandb is not installed. Fix: pip install "
                         "wandb (or pip install -e .[eval]), or drop --wandb-project") from None
    directory = logging_section.wandb_save_dir or os.path.join(run_dir or ".", "wandb")
    os.makedirs(directory, exist_ok=True)
    return wandb.init(project=logging_section.wandb_project, name=logging_section.wandb_exp_name,
                      dir=directory, mode="offline", reinit="finish_previous")
