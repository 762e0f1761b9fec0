"""Held-out tokens for the analysis tools: the run's own evaluation batches, or seeded
random tokens, and per-token NLL in Megatron's [S, B] order.

Legend: B sequences, S sequence length, T = S*B tokens in [S, B] flattened order (the order
inside Megatron's MoE layers).

Design choices:
- Held-out batches come from the run's own `data/run_data.RunData.eval_iterator(domain)`
  (the trainer's evaluation data) when a data path is set; without one the tools fall
  back to seeded uniform random tokens and SAY so in their output (fine for a freshly
  initialised model's plumbing, meaningless for NLL).
- NLL is returned per token in [S, B] order so it lines up with the MoE layers' tokens.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_mvmoe.config.run_config import RunConfig

SYNTHETIC = "synthetic-uniform"


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
