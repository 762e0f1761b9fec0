"""Models and held-out tokens for the analysis tools: a run config (preset, YAML or the one
stored in a checkpoint) -> the GPTModel of this rank (trained weights when a checkpoint is
given, a fresh init otherwise) and per-domain held-out batches.

Legend: B sequences, S sequence length, T = S*B tokens in [S, B] flattened order (the order
inside Megatron's MoE layers).

Design choices:
- The model is built by `models/build.build_model` (the very chunks the trainer wraps in
  DDP, seeded the same way) and filled by `checkpointing/weights.load_weights` (manifest
  verified, fingerprint checked, weights only), so the analysis sees exactly the trained
  model without a trainer, optimizer or DDP, and never re-implements model building.
- Held-out batches come from the run's own `data/run_data.RunData.eval_iterator(domain)`
  (the trainer's evaluation data) when a data path is set; without one the tools fall
  back to seeded uniform random tokens and SAY so in their output (fine for a freshly
  initialised model's plumbing, meaningless for NLL).
- NLL is returned per token in [S, B] order so it lines up with the MoE layers' tokens.
- Must run inside an initialised process group (the tools use the test spawner with one
  rank, or torchrun); dense evaluation needs EP = 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron_mvmoe.config.run_config import (RunConfig, config_from_dict, read_yaml,
                                              saved_config_from_dict, set_field)
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig

SYNTHETIC = "synthetic-uniform"


def run_config(preset: Optional[str] = None, config_path: Optional[str] = None,
               checkpoint: Optional[str] = None, overrides: Optional[Dict] = None) -> RunConfig:
    """The run config from a checkpoint's stored config, a YAML file, or a preset name, with
    `overrides` ({"section.field[.field]": value}) set before it is loaded and checked."""
    if checkpoint is not None:
        from megatron_mvmoe.checkpointing.directory import read_run_state, resolve_checkpoint

        raw = read_run_state(resolve_checkpoint(checkpoint)).get("config")
        if raw is None:
            raise ValueError(f"--checkpoint {checkpoint}: no stored run config. Fix: also "
                             "pass --config with the YAML the run was trained with")
    elif config_path is not None:
        raw = read_yaml(config_path)
    elif preset is not None:
        raw = {"model": {"preset": preset}}
    else:
        raise ValueError("no model given. Fix: pass --checkpoint, --config or --preset")
    for key, value in (overrides or {}).items():
        set_field(raw, key, value)
    # a checkpoint's config may be of an earlier version; a user's YAML must be exact
    run = saved_config_from_dict(raw) if checkpoint is not None else config_from_dict(raw)
    run.parallel.tp = run.parallel.pp = run.parallel.ep = run.parallel.etp = 1
    run.parallel.vpp = None
    run.optimizer.use_distributed_optimizer = False
    return run


@dataclass
class OpenModel:
    """An evaluation model on this rank."""

    model: torch.nn.Module
    """The GPTModel (eval mode)."""
    run: RunConfig
    config: MVMoETransformerConfig
    """The model's full config (`model.config`)."""
    source: str
    """'checkpoint:<path>' or 'fresh-init(seed=...)'."""


def open_model(run: RunConfig, pg_collection, checkpoint: Optional[str] = None) -> OpenModel:
    """Collective: build the run's model (one chunk, EP = 1) and load `checkpoint`'s
    weights if given."""
    from megatron_mvmoe.models.build import build_model

    chunks = build_model(run, pg_collection)
    if len(chunks) != 1:
        raise ValueError("analysis needs the whole model on one rank (pp = vpp = 1)")
    source = f"fresh-init(seed={run.training.seed})"
    if checkpoint is not None:
        from megatron_mvmoe.checkpointing.fingerprint import run_fingerprint
        from megatron_mvmoe.checkpointing.weights import load_weights

        load_weights(chunks, checkpoint, run_fingerprint(run),
                     allow_unverified=run.training.ckpt_allow_unverified)
        source = f"checkpoint:{os.path.abspath(checkpoint)}"
    model = chunks[0].eval()
    return OpenModel(model, run, model.config, source)


def gpt_token_nll(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token NLL [T] in [S, B] order for a batch dict (tokens, labels, position_ids)."""
    loss_BS = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask_BS = batch.get("loss_mask")
    nll_SB = loss_BS.float().t()
    if mask_BS is not None and not bool((mask_BS > 0).all()):
        return nll_SB.reshape(-1)[mask_BS.t().reshape(-1) > 0]
    return nll_SB.reshape(-1)


def heldout_batches(run: RunConfig, num_batches: int, batch_size: int = 2,
                    seed: int = 0) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    """domain -> `num_batches` held-out batches (or one synthetic 'random' domain)."""

    model = run.model
    if run.data.path is None:
        return {"random": synthetic_batches(num_batches, batch_size, model.seq_length,
                                            model.vocab_size, seed)}
    from megatron_mvmoe.data.run_data import RunData

    run.training.micro_batch_size = batch_size
    data = RunData(run, model.seq_length, model.vocab_size, dp_rank=0, dp_size=1)
    out = {}
    for domain in data.domains:
        stream = data.eval_iterator(domain)
        out[domain] = [next(stream) for _ in range(num_batches)]
    return out


def synthetic_batches(num_batches: int, batch_size: int, seq_length: int, vocab_size: int,
                      seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        window = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=gen)
        batches.append({"tokens": window[:, :-1], "labels": window[:, 1:],
                        "loss_mask": torch.ones(batch_size, seq_length),
                        "position_ids": torch.arange(seq_length).expand(batch_size, -1)})
    return batches
