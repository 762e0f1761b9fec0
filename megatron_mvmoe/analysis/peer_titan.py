"""torchtitan 0.3.0's Qwen3-MoE at the shapes of training/step_bench.py, for tools/bench_peer.py.

Design choices:
- Installed on demand into an ignored directory (`--no-deps --target`: torchtitan and the
  few pure-Python packages its model imports pull in; never another torch), then put on
  sys.path of this process only.
- On CPU torchtitan needs two substitutions, both said in the benchmark's output: its
  language models accept only FlexAttention / varlen (FlexAttention has no CPU backward), so
  the inner attention is its own `ScaledDotProductAttention` (causal, no document mask: one
  document per sequence, as on the project's side); its `GroupedExperts` casts activations
  and weights to bf16 for torch._grouped_mm, so the experts run the same grouped GEMMs in
  fp32.
- torchtitan's default is eager (`compile.enable` false); `compile_blocks` applies its
  per-TransformerBlock torch.compile (what torchtitan.distributed.compile.apply_compile
  does, inductor) for the compiled row, so the output compares eager with eager and
  compiled with compiled. One difference, said in the output: apply_compile's
  fullgraph=True fails on CPU in fp32 (the fake-tensor kernel of torch._grouped_mm accepts
  only bf16), so the fp32 experts run eager inside the compiled blocks (a graph break).
- Same architecture as the project's smoe: RMSNorm pre-norm, QK-norm, RoPE, softmax top-k
  routing with renormalised weights, SwiGLU experts, untied LM head, no biases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

TITAN = "torchtitan==0.3.0"
PURE_PYTHON_DEPS = ("tyro", "docstring-parser", "typeguard", "shtab", "spmd_types==0.2.3")
"""What `import torchtitan.models.qwen3` needs beyond this venv (found by importing it)."""
CPU_NOTE = ("torchtitan on CPU: its SDPA inner attention (ScaledDotProductAttention; its "
            "default FlexAttention has no CPU backward) and fp32 grouped experts (its "
            "GroupedExperts casts to bf16)")


def ensure_installed(target: str) -> None:
    """torchtitan 0.3.0 importable from `target`, installed there first if it is not."""
    if not os.path.isdir(os.path.join(target, "torchtitan")):
        os.makedirs(target, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
               target, TITAN, *PURE_PYTHON_DEPS]
        print("installing: " + " ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"could not install {TITAN} into {target}. Fix: check that PyPI "
                             f"is reachable (pip download {TITAN} --no-deps) or give "
                             "--titan-dir a directory holding it")
    if target not in sys.path:
        sys.path.insert(0, target)


COMPILED_NOTE = ("torchtitan compiled: its per-block torch.compile (inductor), fullgraph off "
                 "with the fp32 grouped experts eager (torch._grouped_mm's fake-tensor kernel "
                 "takes only bf16)")


@torch.compiler.disable
def _fp32_grouped_experts(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward without its bf16 casts (CPU, fp32)."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(h_RF, self.w2_EDF.transpose(-2, -1), offs=offsets_E)


def build_model(fields: Dict, seed: int = 0) -> torch.nn.Module:
    """Qwen3-MoE with step_bench's model `fields` (num_layers, hidden_size, ...)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = _fp32_grouped_experts
    qwen3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    dim, heads, vocab = fields["hidden_size"], fields["num_attention_heads"], fields["vocab_size"]
    head_dim = dim // heads
    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=fields["num_layers"], dim=dim, n_heads=heads,
            n_kv_heads=heads, head_dim=head_dim, moe_hidden_dim=fields["moe_ffn_hidden_size"],
            num_experts=fields["num_experts"], top_k=fields["moe_router_topk"],
            attn_backend="sdpa", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=fields["seq_length"],
                                   theta=10000.0)))
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    model.train()
    return model


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's compile of each TransformerBlock (its `compile.enable`: apply_compile's
    dynamo settings and per-block compile), in place, fullgraph off (COMPILED_NOTE)."""
    torch._dynamo.config.capture_scalar_outputs = True  # as apply_compile: MoE dispatch
    for block in model.layers.children():
        block.compile(backend="inductor", fullgraph=False)
    return model


class TitanStep:
    """The same bare loop as step_bench.BareStep: forward, token-mean cross-entropy,
    backward, clip 1.0, torch AdamW (foreach), zero grads."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-4, clip: float = 1.0):
        self.model, self.clip = model, clip
        self.params: List[torch.nn.Parameter] = [p for p in model.parameters()
                                                 if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.01, foreach=True)

    def __call__(self, batch: Dict[str, torch.Tensor]) -> float:
        logits = self.model(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def matmul_flops_per_token(model: torch.nn.Module, top_k: int, num_experts: int,
                           seq_length: int, num_layers: int, hidden: int) -> int:
    """Forward FLOPs per token: 2 x the matrix weights a token meets (routed experts' 3-D
    weights, and any 2-D weight named like an expert, counted top_k / num_experts; the
    embedding table is a lookup) plus causal-free attention 2 x 2 x seq x hidden a layer."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embedding" in name or name.endswith("tok_embeddings.weight"):
            continue
        expert = p.dim() == 3 or "experts" in name
        total += 2 * p.numel() * (top_k / num_experts if expert else 1)
    return int(total + 4 * seq_length * hidden * num_layers)
