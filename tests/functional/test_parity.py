"""Parity calculator (seed 001, Eq. 6-9) against the paper's worked numbers and hand counts."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mvmoe.functional.parity import (
    MoELayerShape,
    derive_mh_moe,
    exact_flops_per_token,
    layer_params,
    leading_flops_per_token,
)

D = 768
SMOE = MoELayerShape(hidden_size=D, num_experts=8, expert_ffn=2048, topk=1)
TOOL = Path(__file__).resolve().parents[2] / "tools" / "parity.py"


def test_smoe_leading_term_is_eq7():
    # Eq. 7 leading term with two matrices: 4 d d_moe k per token.
    two = MoELayerShape(hidden_size=D, num_experts=8, expert_ffn=2048, topk=1, expert_matrices=2)
    assert leading_flops_per_token(two) == 4 * D * 2048
    # SwiGLU: three matrices, 6 d d_moe k.
    assert leading_flops_per_token(SMOE) == 6 * D * 2048


def test_mh_moe_expert_flops_do_not_depend_on_heads():
    # Eq. 6: head + merge each 2 d^2; experts 4 d d_moe k for two matrices, whatever H is.
    for heads in (1, 2, 3, 4):
        shape = MoELayerShape(hidden_size=D, num_experts=8, expert_ffn=512, topk=2,
                              num_heads=heads, head_projection=True, merge_projection=True,
                              expert_matrices=2)
        assert leading_flops_per_token(shape) == 2 * 2 * D * D + 4 * D * 512 * 2


@pytest.mark.parametrize("heads, ffn, experts, topk", [(2, 768, 40, 2), (3, 512, 96, 3)])
def test_derivation_reproduces_paper_configs(heads, ffn, experts, topk):
    derived = derive_mh_moe(SMOE, heads)
    assert derived.exact_ffn == ffn  # Eq. 8 lands exactly on the paper's width (SwiGLU count)
    assert (derived.shape.expert_ffn, derived.shape.num_experts, derived.shape.topk) == (
        ffn, experts, topk)
    assert derived.flops_deviation == 0.0
    assert abs(derived.params_deviation) == pytest.approx(1 / 32)  # E rounded to a multiple of 8


def test_exact_eq9_solutions_before_rounding():
    assert derive_mh_moe(SMOE, 2).exact_experts == pytest.approx(124 / 3)  # 41.33 -> 40
    assert derive_mh_moe(SMOE, 3).exact_experts == pytest.approx(93.0)  # -> 96


def test_two_matrix_convention_does_not_reproduce_paper():
    two = MoELayerShape(hidden_size=D, num_experts=8, expert_ffn=2048, topk=1, expert_matrices=2)
    assert derive_mh_moe(two, 2).exact_ffn == pytest.approx(640)  # not 768
    assert derive_mh_moe(two, 3).exact_ffn == pytest.approx(1280 / 3)  # not 512
    assert derive_mh_moe(two, 3).shape.num_experts == 112  # not 96


def test_summary_worked_parameter_numbers_with_two_matrices():
    # "Each expert has 2 * 384 * 768 = 589,824 parameters ... total 24,772,608"
    h2 = MoELayerShape(hidden_size=D, num_experts=40, expert_ffn=768, topk=2, num_heads=2,
                       head_projection=True, merge_projection=True, expert_matrices=2)
    assert layer_params(h2).expert == 2 * 384 * 768 == 589_824
    assert layer_params(h2).paper_total == 24_772_608
    h3 = MoELayerShape(hidden_size=D, num_experts=96, expert_ffn=512, topk=3, num_heads=3,
                       head_projection=True, merge_projection=True, expert_matrices=2)
    assert layer_params(h3).expert == 262_144
    assert layer_params(h3).paper_total == 26_345_472
    base = MoELayerShape(hidden_size=D, num_experts=8, expert_ffn=2048, topk=1, expert_matrices=2)
    assert layer_params(base).paper_total == 25_165_824


def test_head_merge_param_tax_and_router():
    h3 = derive_mh_moe(SMOE, 3).shape
    params = layer_params(h3)
    assert params.projections == 2 * D * D
    assert params.router == (D // 3) * 96
    assert params.experts_active == 3 * 3 * 3 * 256 * 512


def test_exact_flops_hand_count_tiny():
    # D=4, E=2, F=3, k=1, SwiGLU, no projections: hand count per token.
    shape = MoELayerShape(hidden_size=4, num_experts=2, expert_ffn=3, topk=1)
    gate = 2 * (2 * 4 - 1) + 3 * 2  # router matmul + softmax
    expert = 2 * 3 * (2 * 4 - 1) + 3 * 3 + 3 + 4 * (2 * 3 - 1)  # gate/up, SiLU, product, down
    combine = 4  # scale by the gate, k - 1 = 0 additions
    exact = exact_flops_per_token(shape)
    assert (exact.gating, exact.experts, exact.projections) == (gate, expert + combine, 0)


def test_gating_share_grows_with_heads_and_experts():
    shares = [exact_flops_per_token(derive_mh_moe(SMOE, h).shape).gating_share for h in (2, 3)]
    base = exact_flops_per_token(SMOE).gating_share
    assert base < shares[0] < shares[1] < 0.02


def test_refuses_heads_not_dividing_hidden():
    with pytest.raises(ValueError, match="num_heads"):
        derive_mh_moe(SMOE, 5)


def test_refuses_nonpositive_expert_width():
    # Expert budget 3 * 300 * 1 < head + merge 2 * 768: no positive d_mhmoe exists.
    with pytest.raises(ValueError, match="FLOPs parity impossible"):
        derive_mh_moe(MoELayerShape(D, 8, 300, 1), 2)


def test_tool_json_and_refusal():
    out = subprocess.run([sys.executable, str(TOOL), "--json"], capture_output=True, text=True,
                         check=True)
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["mh_moe_h3"]["experts"] == 96 and rows["mh_moe_h3"]["within_tolerance"]
    bad = subprocess.run([sys.executable, str(TOOL), "--config", "--heads", "5"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "do not divide hidden_size" in bad.stderr
