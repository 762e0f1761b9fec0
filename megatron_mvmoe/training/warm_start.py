"""Warm start (`--warm-start-from`): a latent-MoE baseline checkpoint written by this trainer
initialises a multi_view / multi_router model before its first step.

Order: check the target variant (before anything is built) -> read the baseline's
run_state.json -> compare the baseline's model with this run's, naming every differing
field -> build the baseline's model chunks at THIS run's layout, uninitialised -> load its
weights through dist-checkpointing (so a baseline saved at any TP/PP/EP layout reshards)
-> map each baseline chunk into the matching target chunk with
`models.warm_start.warm_start_multi_view` (router head 0 + new heads fresh|copy, gamma
ramps restart at step 0) -> refresh the optimizer's main parameters from the model.

Upcycling (`training.moe_use_upcycling`, Megatron-LM's --moe-use-upcycling): the same
steps with a DENSE checkpoint, mapped by `models.upcycling.upcycle_chunk` (Megatron-Core's
`upcycle_state_dict` for smoe; the zero-padded identity for the latent variants).

Design choices:
- Both models live at the same layout on the same process groups, so every local shard of
  the baseline has the local shape of its target counterpart: the mapping is per rank,
  no communication. The baseline chunks are dropped afterwards.
- The baseline's optimizer state, step, scheduler and data position are not loaded: the run
  starts at step 0 with fresh Adam moments.
- Building the baseline runs under a forked RNG, so a warm-started run draws the same
  random numbers afterwards as an ordinary one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Dict, List

import torch
from megatron.core import dist_checkpointing

from megatron_mvmoe import platform
from megatron_mvmoe.checkpointing import directory as ckpt_dir
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.weights import model_sharded_state_dict, set_model_weights
from megatron_mvmoe.config.model_section import ARCHITECTURE_FIELDS, ModelSection
from megatron_mvmoe.config.run_config import RunConfig, saved_config_from_dict
from megatron_mvmoe.config.variants import VARIANTS
from megatron_mvmoe.models.build import model_config
from megatron_mvmoe.models.provider import build_model_chunks
from megatron_mvmoe.models.upcycling import upcycle_chunk, upcycle_problems
from megatron_mvmoe.models.warm_start import WarmStartReport, warm_start_multi_view
from megatron_mvmoe.training.build import Trainer

def target_variants() -> tuple:
    """("multi_router", "multi_view", and any registered like them): the variants whose
    extra router heads (and views) start from a baseline checkpoint (read from the records
    when asked, so a registered variant counts)."""
    return tuple(n for n, v in VARIANTS.items() if v.multi_router)


def upcycle_variants() -> tuple:
    """("smoe", "latent", "multi_router", "multi_view", ...): experts that can hold the
    dense MLP."""
    return tuple(n for n, v in VARIANTS.items() if v.routed_experts and not v.multi_head)
# A dense checkpoint and its upcycled MoE model share everything but the MLPs.
_UPCYCLE_SHARED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads",
                          "num_query_groups", "vocab_size", *ARCHITECTURE_FIELDS)
# ModelSection fields that must agree between baseline and target (everything the latent
# backbone's parameters are made of); routers and views are what the warm start adds.
_SHARED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
                  "moe_shared_expert_intermediate_size", "latent_size", "vocab_size",
                  *ARCHITECTURE_FIELDS)


def check_target(model: ModelSection, upcycling: bool = False) -> None:
    """The run's own model must have routers to warm start, or (upcycling) be an MoE variant
    a dense model can be upcycled into (checked before building)."""
    if upcycling:
        if model.moe_variant not in upcycle_variants():
            raise ValueError(
                f"training.moe_use_upcycling: this run's model.moe_variant is "
                f"{model.moe_variant!r}; a dense model upcycles into one of "
                f"{upcycle_variants()} (mh_moe experts see D/H-wide sub-tokens, so none can "
                "hold the dense MLP). Fix: choose one of those variants")
        return
    if model.moe_variant not in target_variants():
        raise ValueError(f"training.warm_start_from: this run's model.moe_variant is "
                         f"{model.moe_variant!r}; the warm start maps a latent baseline into "
                         f"one of {target_variants()}. Fix: use --moe-variant multi_view (or "
                         "multi_router), or drop --warm-start-from")


def has_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint root with a `latest` pointer or a checkpoint dir."""
    return any(os.path.isfile(os.path.join(path, name))
               for name in (ckpt_dir.LATEST, ckpt_dir.RUN_STATE))


def warm_start(trainer: Trainer, path: str, new_heads: str) -> List[WarmStartReport]:
    """Collective: load the baseline at `path` into the trainer's model (see module doc);
    with `training.moe_use_upcycling` the checkpoint is dense and is upcycled instead."""
    upcycling = trainer.run.training.moe_use_upcycling
    model = trainer.model_section
    check_target(model, upcycling)
    directory = _baseline_directory(path)
    meta = ckpt_dir.read_run_state(directory)
    baseline_run = _baseline_run(meta, trainer.run)
    if upcycling:
        check_dense_source(baseline_run.model, model, directory, trainer.run.parallel,
                           new_heads)
        baseline_run.parallel = dataclasses.replace(baseline_run.parallel, ep=1, etp=1)
    else:
        check_baseline(baseline_run.model, model, directory)
    with torch.random.fork_rng(devices=[]):
        baseline_chunks = _load_baseline(baseline_run, trainer.pg_collection, directory)
    reports = []
    with torch.no_grad():
        for source, target in zip(baseline_chunks, trainer.unwrapped()):
            reports.append(upcycle_chunk(target, source, model.moe_variant, new_heads)
                           if upcycling else
                           warm_start_multi_view(target, source.state_dict(), new_heads))
        # bf16 runs keep fp32 main copies inside the optimizer: refresh them from the model
        # (fp32 runs share the storage; the call is then a no-op copy).
        trainer.optimizer.reload_model_params()
    return reports


def check_dense_source(dense: ModelSection, target: ModelSection, directory: str,
                       parallel, new_heads: str = "fresh") -> None:
    """ValueError naming every field in which the dense checkpoint cannot be upcycled into
    the target (models/upcycling.upcycle_problems, the shared backbone fields, and the
    expert TP size: each rank maps its own TP shard of the dense MLP into its experts, which
    only fits when the experts are split the same way)."""
    problems = [f"{name}: checkpoint {getattr(dense, name)!r} vs this run "
                f"{getattr(target, name)!r}" for name in _UPCYCLE_SHARED_FIELDS
                if getattr(dense, name) != getattr(target, name)]
    problems += upcycle_problems(dense, target, new_heads)
    if parallel.tp > 1 and parallel.etp != parallel.tp:
        problems.append(f"parallel.etp: {parallel.etp} with tp {parallel.tp}: each rank holds "
                        "a TP shard of the dense MLP; use --expert-tensor-parallel-size "
                        f"{parallel.tp}, or upcycle at tp 1 and reshard the saved checkpoint")
    if problems:
        raise ValueError(f"training.moe_use_upcycling {directory}: the dense checkpoint "
                         "cannot be upcycled into this model; " + "; ".join(problems))


def check_baseline(baseline: ModelSection, target: ModelSection, directory: str) -> None:
    """ValueError naming every field in which the baseline cannot initialise the target."""
    problems = []
    routers = baseline.multi_view.num_routers
    if not baseline.is_latent or routers != 1:
        problems.append(f"moe_variant: checkpoint {baseline.moe_variant!r} with "
                        f"{routers} router(s), need 'latent' (one router)")
    for name in _SHARED_FIELDS:
        if getattr(baseline, name) != getattr(target, name):
            problems.append(f"{name}: checkpoint {getattr(baseline, name)!r} vs this run "
                            f"{getattr(target, name)!r}")
    if baseline.bitnet.enabled != target.bitnet.enabled:
        problems.append(f"bitnet.enabled: checkpoint {baseline.bitnet.enabled} vs this run "
                        f"{target.bitnet.enabled}")
    if problems:
        raise ValueError(f"training.warm_start_from {directory}: the baseline does not fit "
                         "this model; " + "; ".join(problems) + ". Fix: set these model "
                         "fields to the baseline's (its run_state.json 'config'), or warm "
                         "start from a latent baseline of this architecture")


# ------------------------------------------------------------------------------ steps
def _baseline_directory(path: str) -> str:
    if not has_checkpoint(path):
        raise CheckpointError(
            f"--warm-start-from {path}: no checkpoint here (no '{ckpt_dir.LATEST}' file and no "
            f"{ckpt_dir.RUN_STATE}). Fix: pass the --save directory of a latent baseline run "
            "(or one of its iter_* directories)")
    return ckpt_dir.resolve_checkpoint(path)


def _baseline_run(meta: Dict, run: RunConfig) -> RunConfig:
    """This run's config with the baseline's model section (layout and precision: ours)."""
    saved = (meta.get("config") or {}).get("model") or {}
    baseline = copy.deepcopy(run)
    baseline.model = saved_config_from_dict({"model": saved}).model
    return baseline


def _load_baseline(run: RunConfig, pg_collection, directory: str) -> List[torch.nn.Module]:
    config = model_config(run)
    config.perform_initialization = False  # every weight is overwritten by the load
    chunks = build_model_chunks(config, run.model, pg_collection)
    device = platform.device()
    for chunk in chunks:
        chunk.to(device)
    try:
        loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), directory)
    except Exception as err:
        raise CheckpointError(
            f"--warm-start-from {directory}: reading the baseline's tensors failed "
            f"({type(err).__name__}: {err}). Fix: pass an intact checkpoint of a latent "
            "baseline written by megatron_mvmoe") from err
    set_model_weights(chunks, loaded)
    return chunks


def warm_start_lines(reports: List[WarmStartReport], training, model: ModelSection
                     ) -> List[str]:
    """The log lines of a finished warm start (or upcycling) into `model`: what was copied,
    extended and kept, and the gamma-ramp warning when the views are not inert."""
    copied = sum(len(r.copied) for r in reports)
    kept = sum(len(r.kept) for r in reports)
    if training.moe_use_upcycling:
        return [f"upcycled the dense checkpoint {training.warm_start_from} "
                f"({reports[0].mapping} mapping): {copied} tensors copied, "
                f"{sum(len(r.experts) for r in reports)} expert tensors from the dense MLPs, "
                f"{kept} kept at init (routers); step 0, fresh optimizer"]
    heads = sum(len(r.router_head0) for r in reports)
    lines = [f"warm start from {training.warm_start_from} (new heads: "
             f"{training.warm_start_new_heads}): {copied} tensors copied, {heads} routers "
             f"extended, {kept} kept at init; step 0, fresh optimizer"]
    if model.variant.has_gamma_ramp and model.multi_view.gamma_ramp_steps == 0:
        lines.append("warning: gamma_ramp_steps = 0, so gamma is 1 from the first step and "
                     "the views are not inert at the warm start (set --gamma-ramp-steps > 0 "
                     "to start from the baseline's function)")
    return lines
