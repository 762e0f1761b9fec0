"""Text generation with a trained model: greedy or top-p (nucleus) sampling.

Legend: B batch (1), S tokens so far, V vocabulary (padded).

Design choices:
- No KV cache: each new token runs the whole (windowed) sequence through the model.
  Simple and correct for every variant and layout the trainer supports (the MoE
  layers, their dispatchers and Multi-View mixing run exactly as in evaluation); fine for
  the short texts researchers inspect. Inputs longer than seq_length keep the last
  seq_length tokens (RoPE positions restart at 0 for the window).
- Every rank runs the same forward (expert parallelism needs all ranks); the logits are
  gathered over TP, the next token is chosen on global rank 0 and broadcast, so every
  rank appends the same token whatever its RNG.
- Padded vocabulary rows (ids >= the tokenizer's vocabulary) are never chosen.
- Pipeline parallelism is refused (generation would need the schedule per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_mvmoe import platform


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new_tokens: int = 32
    greedy: bool = True
    """Greedy (arg max); False = top-p sampling."""
    top_p: float = 0.9
    """Nucleus: sample among the most likely tokens whose probabilities sum to top_p."""
    temperature: float = 1.0
    seed: int = 1234
    stop_at_eod: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]. Fix: e.g. 0.9")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0. Fix: e.g. 1.0")


def top_p_filter(logits_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with every token outside the smallest set of mass >= top_p set to -inf."""
    sorted_V, order_V = torch.sort(logits_V, descending=True)
    cumulative_V = torch.softmax(sorted_V, dim=-1).cumsum(dim=-1)
    drop_V = cumulative_V - torch.softmax(sorted_V, dim=-1) >= top_p  # keep the first over
    filtered = logits_V.clone()
    filtered[order_V[drop_V]] = float("-inf")
    return filtered


def choose_next(logits_V: torch.Tensor, config: SamplingConfig, vocab_size: int,
                generator: torch.Generator) -> int:
    logits_V = logits_V.float().clone()
    logits_V[vocab_size:] = float("-inf")  # padded rows are not tokens
    if config.greedy:
        return int(torch.argmax(logits_V))
    filtered = top_p_filter(logits_V / config.temperature, config.top_p)
    return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator))


@torch.no_grad()
def sequence_logits(model: torch.nn.Module, tokens: List[int]) -> torch.Tensor:
    """Logits [S, V] after each of `tokens` (at most seq_length of them), gathered over TP."""
    device = platform.device()
    tokens_BS = torch.tensor([tokens], dtype=torch.long, device=device)
    positions_BS = torch.arange(len(tokens), device=device).unsqueeze(0)
    logits_BSV = model(tokens_BS, positions_BS, None)
    tp_group = model.pg_collection.tp  # the groups the model was built on
    if tp_group.size() > 1:
        logits_BSV = gather_from_tensor_model_parallel_region(logits_BSV, tp_group)
    return logits_BSV[0].float().cpu()


def last_logits(model: torch.nn.Module, tokens: List[int], seq_length: int) -> torch.Tensor:
    """Logits [V] of the next token after `tokens` (the last seq_length of them)."""
    return sequence_logits(model, tokens[-seq_length:])[-1]


def generate(model: torch.nn.Module, prompt_ids: List[int], config: SamplingConfig,
             seq_length: int, vocab_size: int, eod_id: Optional[int] = None,
             progress=None) -> List[int]:
    """The new token ids after `prompt_ids` (collective: every rank calls it)."""
    if model.pg_collection.pp.size() > 1:
        raise ValueError("generation: pipeline parallelism is not supported. Fix: "
                         "--pipeline-model-parallel-size 1 (the checkpoint reshards)")
    if not prompt_ids:
        raise ValueError("prompt: empty after tokenizing. Fix: give some text")
    model.eval()
    generator = torch.Generator().manual_seed(config.seed)
    tokens, new = list(prompt_ids), []
    for index in range(config.max_new_tokens):
        logits_V = last_logits(model, tokens, seq_length)
        chosen = torch.tensor([choose_next(logits_V, config, vocab_size, generator)],
                              device=platform.device())
        dist.broadcast(chosen, src=0)  # gloo-friendly CPU tensor; the same token everywhere
        token = int(chosen)
        if config.stop_at_eod and eod_id is not None and token == eod_id:
            break
        tokens.append(token)
        new.append(token)
        if progress is not None and (index + 1) % 16 == 0:
            progress(f"{index + 1}/{config.max_new_tokens} tokens")
    return new
