"""FLOPs and parameter parity of SMoE, fine-grained SMoE and MH-MoE layers (seed 001, Eq. 6-9).

Pure python (no torch): every number here is a closed-form count per MoE layer and per token.

Legend: D hidden size, E experts, F expert intermediate (ffn) size, k top-k per routed row,
H MH-MoE heads (sub-tokens per token), m matrices per expert, P number of D x D projections
(head + merge, 0..2), T tokens.

Counting conventions (the paper's, made explicit):
- A [T, n] x [n, m] matmul without bias costs T * (2nm - m) scalar operations: per output, n
  multiplications and n - 1 additions. Eq. 6 writes the head layer as 2Td^2 - Td. The
  *leading term* keeps only 2Tnm (2 FLOPs per multiply-accumulate). Gating is not in it.
- MH-MoE experts see sub-tokens of D / H, but each token sends H sub-tokens to k experts each,
  so expert FLOPs per token are H * k * m * (D/H) * F * 2 = 2 m D F k: independent of H. That
  is why the paper's Eq. 7 has 4 T d d_moe k for two matrices (m = 2).
- Matrices per expert, m. The summary's Eq. 7 and 9 write an expert as TWO matrices
  (W1: D x F, W2: F x D) and quotes "2 * 384 * 768" parameters per 2-head expert. With m = 2,
  Eq. 8 (d_mhmoe = d_moe - d/k, generalised below to a top-k change) gives F = 640 for
  (H=2, k=2) and 426.7 for (H=3, k=3), NOT the 768 and 512 the paper trains. The experts are
  SwiGLU (gate, up, down: THREE matrices). With m = 3 the same equations give exactly
  F = 768 and F = 512: the head + merge cost 2 D^2 is paid by (2/3) D of SwiGLU width.
  So we default to m = 3 (`expert_matrices=3`); m = 2 stays selectable to reproduce the
  summary's per-expert numbers.
- Expert count. Eq. 9 solved exactly gives 41.33 experts (H=2) and 93.0 (H=3) with m = 3.
  The paper's 40 and 96 are these rounded to the nearest multiple of 8 (`expert_multiple=8`,
  an expert count that shards over 8-way expert parallelism). With m = 2 the exact values are
  40.67 and 91.5, which round to 40 and 88, not 96: a second sign that the paper counts m = 3.
  The rounding leaves the paper's MoE layers at -3.125 % (H=2) and +3.125 % (H=3) parameters.

Generalised Eq. 8 and 9 (the paper's have k_mh = k_moe and m = 2, P = 2):
    FLOPs:  P D^2 + m D F_mh k_mh = m D F_moe k_moe
            => F_mh = (m F_moe k_moe - P D) / (m k_mh)
    params: P D^2 + E_mh m (D/H) F_mh = E_moe m D F_moe
            => E_mh = (E_moe m D F_moe - P D^2) / (m (D/H) F_mh)
A shared expert (same in both) and the router are left out of both sides, as in the paper.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_mvmoe.errors import require as _require

FLOPS_TOLERANCE = 0.01
"""Matched presets: |leading-term FLOPs per MoE layer - baseline's| / baseline's at most this.
The paper's configurations are exact (0 %); 1 % leaves room for integer rounding of F."""

PARAMS_TOLERANCE = 0.05
"""Matched presets: |total parameters per MoE layer - baseline's| / baseline's at most this.
Rounding E to a multiple of 8 costs the paper's layers 3.125 %; whole models differ less."""

SOFTMAX_OPS_PER_EXPERT = 3
"""Exact count of the gate's softmax: one exp, one add (into the sum), one division per expert."""

SILU_OPS = 3
"""Exact count of SiLU(x) = x / (1 + exp(-x)): one exp, one add, one division (exp counted as 1)."""




@dataclass(frozen=True)
class MoELayerShape:
    """Dimensions of one MoE layer, enough to count its parameters and FLOPs."""

    hidden_size: int
    """D: model hidden size entering and leaving the layer."""

    num_experts: int
    """E: routed experts."""

    expert_ffn: int
    """F: intermediate size of each routed expert."""

    topk: int
    """k: experts selected per routed row (per sub-token for MH-MoE)."""

    num_heads: int = 1
    """H: sub-tokens per token (D / H each), each routed on its own. 1 = SMoE."""

    head_projection: bool = False
    """A D x D head projection before the split (MH-MoE; Table 4/5 ablations)."""

    merge_projection: bool = False
    """A D x D merge projection after the concatenation."""

    split_tokens: bool = True
    """False routes whole tokens even when num_heads > 1 (Table 4: SMoE + head/merge)."""

    shared_expert_ffn: int = 0
    """Intermediate size of a shared expert on the full D-wide token; 0 = none."""

    expert_matrices: int = 3
    """m: 3 for SwiGLU experts (gate, up, down; the paper's models), 2 for the two-matrix
    count the summary's Eq. 7 and 9 use. Applies to the shared expert too."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "expert_ffn", "topk", "num_heads"):
            value = getattr(self, name)
            _require(value >= 1, name, f"must be >= 1, got {value}", "use a positive size")
        _require(self.topk <= self.num_experts, "topk",
                 f"top-k {self.topk} exceeds num_experts {self.num_experts}",
                 f"use a top-k of at most {self.num_experts}")
        _require(self.hidden_size % self.num_heads == 0, "num_heads",
                 f"{self.num_heads} heads do not divide hidden_size {self.hidden_size}",
                 "choose a head count that divides hidden_size")
        _require(self.expert_matrices in (2, 3), "expert_matrices",
                 f"must be 2 or 3, got {self.expert_matrices}", "use 3 for SwiGLU experts")
        _require(self.shared_expert_ffn >= 0, "shared_expert_ffn",
                 f"must be >= 0, got {self.shared_expert_ffn}", "use 0 for no shared expert")

    @property
    def routed_rows(self) -> int:
        """Routed rows (sub-tokens) per token: H when splitting, else 1."""
        return self.num_heads if self.split_tokens else 1

    @property
    def expert_input(self) -> int:
        """Width an expert and the router see: D / H when splitting, else D."""
        return self.hidden_size // self.routed_rows

    @property
    def num_projections(self) -> int:
        """P: how many D x D projections (head, merge) the layer has."""
        return int(self.head_projection) + int(self.merge_projection)


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one MoE layer, by component."""

    projections: int
    """Head + merge: P * D^2."""
    expert: int
    """One routed expert: m * d_in * F."""
    experts_total: int
    """All routed experts: E * expert."""
    experts_active: int
    """Expert weights used per token: routed_rows * k * expert (FLOPs-equivalent activation:
    sub-tokens of one token may share an expert, so distinct weights can be fewer)."""
    router: int
    """Router weight: d_in * E (Megatron's router has no bias)."""
    shared: int
    """Shared expert: m * D * F_shared."""

    @property
    def total(self) -> int:
        return self.projections + self.experts_total + self.router + self.shared

    @property
    def active(self) -> int:
        return self.projections + self.experts_active + self.router + self.shared

    @property
    def paper_total(self) -> int:
        """What Eq. 9 compares: projections + routed experts (no router, no shared expert)."""
        return self.projections + self.experts_total


def layer_params(shape: MoELayerShape) -> LayerParams:
    """Count the parameters of one MoE layer."""
    expert = shape.expert_matrices * shape.expert_input * shape.expert_ffn
    return LayerParams(
        projections=shape.num_projections * shape.hidden_size ** 2,
        expert=expert,
        experts_total=shape.num_experts * expert,
        experts_active=shape.routed_rows * shape.topk * expert,
        router=shape.expert_input * shape.num_experts,
        shared=shape.expert_matrices * shape.hidden_size * shape.shared_expert_ffn,
    )


def leading_flops_per_token(shape: MoELayerShape, include_shared: bool = True) -> int:
    """Eq. 6-7 leading term per token: 2 * (P D^2 + H k m (D/H) F [+ m D F_shared]).

    Gating is excluded, as in the paper."""
    macs = shape.num_projections * shape.hidden_size ** 2
    macs += shape.routed_rows * shape.topk * shape.expert_matrices * shape.expert_input \
        * shape.expert_ffn
    if include_shared:
        macs += shape.expert_matrices * shape.hidden_size * shape.shared_expert_ffn
    return 2 * macs


def _matmul_ops(n_in: int, n_out: int) -> int:
    """Exact ops for one row through an n_in x n_out matmul without bias: n_out (2 n_in - 1)."""
    return n_out * (2 * n_in - 1)


def _expert_ops(d_in: int, ffn: int, matrices: int) -> int:
    """Exact ops for one row through one expert: SwiGLU (3) or plain activation FFN (2)."""
    up = _matmul_ops(d_in, ffn) * (matrices - 1)
    activation = SILU_OPS * ffn + (ffn if matrices == 3 else 0)  # SiLU, then gate * up
    return up + activation + _matmul_ops(ffn, d_in)


@dataclass(frozen=True)
class ExactFlops:
    """Exact scalar operations per token of one MoE layer, by component."""

    projections: int
    """Head and merge matmuls: P * D (2D - 1)."""
    gating: int
    """Router matmul d_in x E plus softmax, per routed row."""
    experts: int
    """k experts per routed row, plus the gate-weighted sum of their outputs."""
    shared: int
    """Shared expert on the full token, plus its addition to the routed output."""

    @property
    def total(self) -> int:
        return self.projections + self.gating + self.experts + self.shared

    @property
    def gating_share(self) -> float:
        """Fraction of the exact total spent in the gating network."""
        return self.gating / self.total


def exact_flops_per_token(shape: MoELayerShape) -> ExactFlops:
    """Count every scalar operation per token, including gating (top-k selection is
    comparisons, not arithmetic, and is not counted)."""
    d_in, rows, k = shape.expert_input, shape.routed_rows, shape.topk
    gating = rows * (_matmul_ops(d_in, shape.num_experts)
                     + SOFTMAX_OPS_PER_EXPERT * shape.num_experts)
    weighted_sum = k * d_in + (k - 1) * d_in  # scale each slot's output, add the k outputs
    experts = rows * (k * _expert_ops(d_in, shape.expert_ffn, shape.expert_matrices)
                      + weighted_sum)
    shared = 0
    if shape.shared_expert_ffn:
        shared = _expert_ops(shape.hidden_size, shape.shared_expert_ffn, shape.expert_matrices)
        shared += shape.hidden_size
    projections = shape.num_projections * _matmul_ops(shape.hidden_size, shape.hidden_size)
    return ExactFlops(projections=projections, gating=gating, experts=experts, shared=shared)


def relative_deviation(value: float, reference: float) -> float:
    """(value - reference) / reference."""
    return (value - reference) / reference


@dataclass(frozen=True)
class DerivedMHMoE:
    """An MH-MoE layer derived from a baseline by Eq. 8-9, with the unrounded solutions."""

    shape: MoELayerShape
    exact_ffn: float
    """Eq. 8 solution before rounding to an integer."""
    exact_experts: float
    """Eq. 9 solution before rounding to a multiple of expert_multiple."""
    flops_deviation: float
    """Leading-term FLOPs per token, relative to the baseline."""
    params_deviation: float
    """Eq. 9's parameters (projections + routed experts), relative to the baseline."""


def solve_ffn(base: MoELayerShape, num_projections: int, topk: int) -> float:
    """Generalised Eq. 8: F_mh = (m F_moe k_moe - P D) / (m k_mh).

    The baseline's budget is its whole leading term (its own projections included, if any)."""
    per_d = leading_flops_per_token(base, include_shared=False) / (2 * base.hidden_size)
    return (per_d - num_projections * base.hidden_size) / (base.expert_matrices * topk)


def solve_experts(base: MoELayerShape, num_projections: int, num_heads: int, ffn: int) -> float:
    """Generalised Eq. 9: E_mh = (E m D F_moe - P D^2) / (m (D/H) F_mh)."""
    d = base.hidden_size
    budget = layer_params(base).paper_total
    return (budget - num_projections * d * d) / (base.expert_matrices * (d // num_heads) * ffn)


def _round_to(value: float, multiple: int) -> int:
    return int(round(value / multiple)) * multiple


def derive_mh_moe(base: MoELayerShape, num_heads: int, topk: Optional[int] = None,
                  expert_multiple: int = 8, head_projection: bool = True,
                  merge_projection: bool = True) -> DerivedMHMoE:
    """Derive the FLOPs- and parameter-matched MH-MoE layer for a baseline SMoE layer.

    topk defaults to num_heads * base.topk (the paper: top-1 SMoE -> top-2 for H=2, top-3
    for H=3). The shared expert, if any, is kept as is on both sides. Raises ValueError when
    parity is impossible (H does not divide D, the projections eat the whole expert budget,
    or fewer experts than top-k remain)."""
    _require(num_heads >= 1, "num_heads", f"must be >= 1, got {num_heads}", "use 1 for SMoE")
    _require(base.hidden_size % num_heads == 0, "num_heads",
             f"{num_heads} heads do not divide hidden_size {base.hidden_size}",
             "choose a head count that divides hidden_size")
    _require(expert_multiple >= 1, "expert_multiple", f"must be >= 1, got {expert_multiple}",
             "use 1 for no rounding, 8 as the paper")
    topk = num_heads * base.topk if topk is None else topk
    _require(topk >= 1, "topk", f"must be >= 1, got {topk}", "use num_heads * base top-k")
    projections = int(head_projection) + int(merge_projection)
    exact_ffn = solve_ffn(base, projections, topk)
    _require(exact_ffn >= 1, "expert_ffn",
             f"FLOPs parity impossible: d_mhmoe = {exact_ffn:.2f} <= 0 because the "
             f"{projections} D x D projections cost more than the baseline's expert budget "
             f"({base.expert_matrices} x {base.expert_ffn} x top-{base.topk})",
             "use a baseline with a larger expert_ffn or top-k, or drop head/merge")
    ffn = max(1, int(round(exact_ffn)))
    exact_experts = solve_experts(base, projections, num_heads, ffn)
    experts = max(expert_multiple, _round_to(exact_experts, expert_multiple))
    _require(experts >= topk, "topk",
             f"parameter parity leaves {experts} experts (exact {exact_experts:.2f}), fewer "
             f"than top-{topk}", "lower top-k or raise the baseline's expert count")
    shape = dataclasses.replace(
        base, num_experts=experts, expert_ffn=ffn, topk=topk, num_heads=num_heads,
        head_projection=head_projection, merge_projection=merge_projection, split_tokens=True)
    return DerivedMHMoE(
        shape=shape, exact_ffn=exact_ffn, exact_experts=exact_experts,
        flops_deviation=relative_deviation(leading_flops_per_token(shape),
                                           leading_flops_per_token(base)),
        params_deviation=relative_deviation(layer_params(shape).paper_total,
                                            layer_params(base).paper_total))


def all_to_all_bytes_per_token(shape: MoELayerShape, bytes_per_element: int = 4) -> int:
    """Bytes one token puts into the expert-parallel all-to-all, per direction (dispatch; the
    combine returns the same rows): H * k sub-token rows of D / H = k * D elements. Gates
    (H * k scalars) travel in a separate all-to-all and are not included."""
    return shape.routed_rows * shape.topk * shape.expert_input * bytes_per_element
