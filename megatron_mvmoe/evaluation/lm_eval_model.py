"""An lm-eval (EleutherAI lm-evaluation-harness) model class for our checkpoints.

Legend: S tokens of a window, V vocabulary (padded).

Design choices:
- The checkpoint is rebuilt exactly as tools/generate.py and tools/evaluate.py rebuild it
  (toolkit/checkpoint.py): the run's own model and tokenizer, any layout it reshards
  to. Every process answers every request (so EP/TP ranks run their forwards together) and
  tells lm-eval it is rank 0 of 1; only global rank 0 should print the results.
- loglikelihood: lm-eval's own TemplateLM pairs context and continuation, as it does for its
  hf backend (a context's trailing whitespace moves to the continuation; the whole text is
  encoded and split after the context's tokens; an empty context starts from the EOD token);
  each pair is scored in one window of at most seq_length tokens, truncated from the left.
- loglikelihood_rolling: disjoint windows of seq_length predicted tokens, each conditioned
  on the window's own preceding tokens (the first on EOD), as lm-eval's rolling windows do
  with context length 1.
- generate_until: greedy, cut at the first stop string.
- Log-probabilities are normalised over the whole padded vocabulary (V rows, Megatron-LM's
  --make-vocab-size-divisible-by rule), as Megatron's training loss
  (vocab_parallel_cross_entropy) and Megatron-Core's inference log-probs are, and as
  lm-eval's hf backend does on the tools/export_hf.py export, which keeps every row: one
  log-likelihood for both backends and for tools/evaluate.py's perplexity. Only
  generate_until keeps padded ids out (they are not tokens), as tools/generate.py does.
- Progress: a line on stderr (global rank 0) every 30 s of a long request list, with the
  count done and the rate, so a --tasks standard run is never silent for minutes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megatron_mvmoe.toolkit.generation import SamplingConfig, generate, sequence_logits


@register_model("megatron_mvmoe")
class MVMoELM(TemplateLM):
    """`lm_eval --model megatron_mvmoe --model_args load=<checkpoint>` (after importing this
    module), or `MVMoELM(load=...)` passed to `lm_eval.simple_evaluate`."""

    def __init__(self, load: str, tp: int = 1, ep: int = 1, etp: int = 1,
                 max_gen_toks: int = 32, tokenizer_type: Optional[str] = None,
                 vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                 tokenizer_model: Optional[str] = None, **_unused) -> None:
        super().__init__()
        import argparse

        from megatron_mvmoe.toolkit.checkpoint import (load_model, run_tokenizer,
                                                       tool_session)
        from megatron_mvmoe.toolkit.flags import run_from_flags

        flags = argparse.Namespace(load=load, tp=int(tp), pp=1, ep=int(ep), etp=int(etp),
                                   tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                                   merge_file=merge_file, tokenizer_model=tokenizer_model)
        run = run_from_flags(flags)
        self._stack = contextlib.ExitStack()
        pgs = self._stack.enter_context(tool_session(run))
        loaded = load_model(run, load, pgs)
        self.model = loaded.model[0].eval()
        self.tokenizer = run_tokenizer(run)
        self.seq_length = loaded.model_section.seq_length
        self.max_gen_toks = int(max_gen_toks)

    def close(self) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ scoring
    def _logprobs_SV(self, tokens: List[int]) -> torch.Tensor:
        return torch.log_softmax(sequence_logits(self.model, tokens), dim=-1)

    def score(self, context_ids: List[int], target_ids: List[int]) -> Tuple[float, bool]:
        """(sum of log p(target | context), whether greedy decoding gives the target)."""
        context_ids = context_ids or [self.tokenizer.eod]
        window = (context_ids + target_ids)[-(self.seq_length + 1):]
        logprobs_SV = self._logprobs_SV(window[:-1])
        n = min(len(target_ids), len(window) - 1)  # a target longer than the window: its tail
        targets = torch.tensor(window[-n:])
        rows = logprobs_SV[-n:]
        picked = rows.gather(1, targets.unsqueeze(1)).squeeze(1)
        return float(picked.sum()), bool((rows.argmax(dim=-1) == targets).all())

    # lm-eval's TemplateLM.loglikelihood tokenizes through these two and scores through
    # _loglikelihood_tokens: the same (context, continuation) ids as its hf backend
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens=None, **_unused) -> List[int]:
        return self.tokenizer.tokenize(string)

    def _loglikelihood_tokens(self, requests, **_unused) -> List[Tuple[float, bool]]:
        return [self.score(context_ids, continuation_ids)
                for _, context_ids, continuation_ids in _progress(requests, "loglikelihood")]

    def loglikelihood_rolling(self, requests) -> List[float]:
        out = []
        for request in _progress(requests, "loglikelihood_rolling"):
            ids = self.tokenizer.tokenize(request.args[0])
            total, previous = 0.0, [self.tokenizer.eod]
            for start in range(0, len(ids), self.seq_length):
                chunk = ids[start:start + self.seq_length]
                total += self.score(previous[-1:], chunk)[0]
                previous = chunk
            out.append(total)
        return out

    def generate_until(self, requests) -> List[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            config = SamplingConfig(max_new_tokens=int(kwargs.get("max_gen_toks",
                                                                  self.max_gen_toks)))
            ids = generate(self.model, self.tokenizer.tokenize(context) or
                           [self.tokenizer.eod], config, self.seq_length,
                           self.tokenizer.vocab_size, eod_id=self.tokenizer.eod)
            text = self.tokenizer.detokenize(ids)
            out.append(_cut(text, until))
        return out


def _progress(requests, kind: str, every_s: float = 30.0):
    """Yield `requests`, printing `kind: done/total (rate)` every `every_s` seconds."""
    loud = int(os.environ.get("RANK", "0")) == 0
    start = last = time.time()
    for i, request in enumerate(requests):
        now = time.time()
        if loud and now - last >= every_s:
            print(f"[lm_eval] {kind}: {i}/{len(requests)} requests, "
                  f"{i / (now - start):.1f}/s", file=sys.stderr, flush=True)
            last = now
        yield request
    if loud and requests:
        print(f"[lm_eval] {kind}: {len(requests)} requests in {time.time() - start:.0f} s",
              file=sys.stderr, flush=True)


def _cut(text: str, until: List[str]) -> str:
    cuts = [text.index(stop) for stop in until if stop and stop in text]
    return text[:min(cuts)] if cuts else text
