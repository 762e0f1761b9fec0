"""All local experts as two grouped matmuls on CPU: `GroupedMatmulExperts(SequentialMLP)`.

Legend: N permuted rows on this rank (expert-major, as Megatron's dispatcher hands them
over), E local experts, I expert input width (D, or L in latent space), F expert FFN width
(per expert-TP rank), G = 2F with a gated linear unit else F.

Why: SequentialMLP runs every expert as its own MLP module, two Megatron linears and an
activation each, one after another. With 128 experts and few rows per expert the CPU spends
its time in Python and small GEMMs. Megatron-Core 0.19.2's grouped alternative is
TEGroupedMLP (TransformerEngine, GPU only); the legacy GroupedMLP is gone. torch 2.13's
`torch._grouped_mm` runs on CPU in fp32 and bf16, forward and backward, empty groups included
(probed by `grouped_mm_runs_here`), so here all experts are one grouped GEMM for fc1, one
elementwise activation over all N rows, and one grouped GEMM for fc2.

Design choices:
- A subclass of SequentialMLP that keeps its modules and parameters
  (`local_experts.<i>.linear_fc1.weight` [G, I], `linear_fc2.weight` [I, F]): state dicts,
  `sharded_state_dict` (local -> global expert ids over EP), deterministic init, the
  optimizer and DDP see exactly what they see with SequentialMLP, so checkpoints of either
  load into the other. The weights are stacked per forward ([E, G, I], a copy of the
  expert weights; autograd hands each expert's slice of the grad back to its parameter).
- The arithmetic is SequentialMLP's, row by row: fc1, the GLU split
  `act(x_glu) * (x_linear + glu_linear_offset)` with the same optional clamp, times the
  routing prob, fc2. Only the GEMM call differs (one grouped call instead of
  E calls), so outputs and grads match SequentialMLP's (tests/layers/test_grouped_experts.py).
- Anything this path does not reproduce falls back to SequentialMLP's own forward for that
  call (`grouped_unsupported` says why): expert TP > 1 (row-parallel all-reduce), fp8/fp4,
  expert biases (the project runs bias-free; SequentialMLP's own expert-bias add fails on
  CPU at TP = 1, in place on a custom Function's view), TE activations and fused ones other
  than SwiGLU (Megatron's fused SwiGLU runs here as in its MLP: `weighted_bias_swiglu_impl`
  with the routing probs), delayed
  weight grads, non-local linears (BitNet, TE), CUDA tensors. The fast-path rule
  (models/fast_paths.py, `cpu_grouped_experts`) only turns it on where none of these apply
  and where it is faster: one expert's I x F at most GROUPED_MM_MAX_EXPERT_ELEMENTS.

Where it is slower, and why (measured, examples/results/grouped_experts.md): torch 2.13's
CPU `_grouped_mm` is a loop of per-group GEMMs (the same MKL calls SequentialMLP makes),
so it saves only the per-expert module/autograd overhead, and pays for the stacked copy of
every expert weight per forward, the stacked gradient split back in backward, and the page
faults of those fresh GB-sized buffers (at the 10B-A1B width 0.6-0.8 s of system time per
step of 16 experts). Tried and dropped, both exact-or-close but slower than SequentialMLP's
loop at the real width: a padded `torch.bmm` over experts (the same copies plus padding,
0.5-0.6x), and one autograd Function walking the experts with the activation recomputed
in backward (0.75-0.95x: the recompute costs more than the module overhead it removes).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_mvmoe.layers.builders import parts, rebuilt


@functools.lru_cache(maxsize=None)
def grouped_mm_runs_here(dtype: torch.dtype = torch.float32) -> bool:
    """True if `torch._grouped_mm` computes forward and backward on CPU tensors of `dtype`,
    an empty group included (a tiny probe, checked against a per-group loop)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    x_NI = torch.randn(8, 8, generator=gen).to(dtype).requires_grad_(True)
    w_EOI = torch.randn(3, 16, 8, generator=gen).to(dtype).requires_grad_(True)
    try:
        out_NO = torch._grouped_mm(x_NI, w_EOI.transpose(1, 2),
                                   offs=torch.tensor([4, 4, 8], dtype=torch.int32))
        out_NO.backward(torch.ones_like(out_NO))
    except (RuntimeError, NotImplementedError):
        return False
    ref_NO = torch.cat([x_NI[:4] @ w_EOI[0].t(), x_NI[4:] @ w_EOI[2].t()])
    return bool(torch.allclose(out_NO, ref_NO, atol=1e-2) and w_EOI.grad[1].abs().sum() == 0)


def grouped_experts_spec(experts_spec):
    """The experts builder `experts_spec` (SequentialMLP's) with GroupedMatmulExperts as the
    class: same submodules and params, so the same parameters are built."""
    return rebuilt(experts_spec, module=GroupedMatmulExperts)


def with_grouped_experts(moe_spec, config):
    """Megatron's MoE builder with its experts slot on GroupedMatmulExperts when the fast-path
    rule turned `config.cpu_grouped_experts` on and the slot holds SequentialMLP."""
    if not getattr(config, "cpu_grouped_experts", False):
        return moe_spec
    submodules = parts(moe_spec).submodules
    if parts(submodules.experts).module is not SequentialMLP:
        return moe_spec  # TE's grouped experts (or another class): leave them alone
    from dataclasses import replace

    return rebuilt(moe_spec, submodules=replace(
        submodules, experts=grouped_experts_spec(submodules.experts)))


class GroupedMatmulExperts(SequentialMLP):
    """SequentialMLP's experts and parameters, computed with two grouped GEMMs."""

    def grouped_unsupported(self, rows_NI: torch.Tensor) -> Optional[str]:
        """Why this call must take SequentialMLP's loop, or None when the grouped path runs."""
        c = self.config
        checks = (
            (rows_NI.device.type != "cpu", "CUDA tensors (TEGroupedMLP is the GPU path)"),
            (not grouped_mm_runs_here(rows_NI.dtype), f"torch._grouped_mm fails for "
                                                      f"{rows_NI.dtype} on CPU"),
            (self.tp_group is not None and self.tp_group.size() > 1, "expert TP > 1"),
            (bool(c.fp8 or c.fp4), "fp8/fp4 padding"),
            (c.use_te_activation_func or (c.bias_activation_fusion and not _fused_swiglu(c)),
             "a fused activation other than SwiGLU"),
            (getattr(c, "delay_wgrad_compute", False), "delayed weight grads"),
            (c.gradient_accumulation_fusion, "gradient-accumulation fusion"),
            (not self._local_linears(), "not Megatron's local linears (BitNet/TE)"),
            (c.add_bias_linear, "expert biases"),
            (rows_NI.shape[0] == 0, "no rows"),
        )
        return next((why for bad, why in checks if bad), None)

    def _local_linears(self) -> bool:
        return all(type(e.linear_fc1) is ColumnParallelLinear
                   and type(e.linear_fc2) is RowParallelLinear for e in self.local_experts)

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        rows_NI = permuted_local_hidden_states
        if self.grouped_unsupported(rows_NI) is not None:
            return super().forward(rows_NI, tokens_per_expert, permuted_probs)
        probs_N = permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale rows, probs = 1
            assert self.config.moe_router_topk == 1, "validated by SequentialMLP's contract"
            rows_NI = (probs_N.unsqueeze(-1) * rows_NI).to(rows_NI.dtype)
            probs_N = torch.ones_like(probs_N)
        counts_E = torch.as_tensor(tokens_per_expert, dtype=torch.int64).cpu()
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)  # end row of each group
        fc1 = [e.linear_fc1 for e in self.local_experts]
        fc2 = [e.linear_fc2 for e in self.local_experts]
        hidden_NG = _grouped_linear(rows_NI, fc1, offsets_E)
        if self.config.bias_activation_fusion:  # Megatron's MLP.forward with per_token_scale
            hidden_NF = weighted_bias_swiglu_impl(hidden_NG, None, probs_N.unsqueeze(-1),
                                                  self.config.activation_func_fp8_input_store)
        else:
            hidden_NF = self._activation(hidden_NG)
            hidden_NF = (hidden_NF * probs_N.unsqueeze(-1)).to(hidden_NF.dtype)
        return _grouped_linear(hidden_NF, fc2, offsets_E), None

    def _activation(self, x_NG: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation, on all rows at once."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(x_NG)
        x_glu, x_linear = torch.chunk(x_NG, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)


def _fused_swiglu(c) -> bool:
    """The activation Megatron's MLP fuses as SwiGLU (bias_swiglu_impl)."""
    return (c.gated_linear_unit and c.activation_func is F.silu
            and c.activation_func_clamp_value is None and not c.glu_linear_offset)


def _grouped_linear(x_NI: torch.Tensor, linears, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e through linears[e] (bias-free, weight [O, I]) in one grouped GEMM."""
    weight_EOI = torch.stack([lin.weight for lin in linears])
    out_NO = torch._grouped_mm(x_NI, weight_EOI.transpose(1, 2), offs=offsets_E)
    if out_NO.requires_grad:
        # its backward needs a dense grad; sum() and expand() hand over stride-0 ones
        out_NO.register_hook(lambda grad: grad.contiguous())
    return out_NO
