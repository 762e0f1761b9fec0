"""Per-step losses of fixed tiny runs (every variant, and Multi-View at EP = 2) against the
golden files of this platform, within the declared tolerance. See golden.py."""

import os

import pytest

from golden import (CASES, REGENERATE, STEPS, TOLERANCES, golden_path, platform_name,
                    read_golden, write_golden)
from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)


def run_case(case: str, text_tokens: str):
    spec = CASES[case]
    raw = tiny_run(text_tokens, preset=spec.preset, parallel=spec.parallel, train_iters=STEPS,
                   eval_iters=0)
    return train(raw, spec.world)["losses"]


def compare(losses, golden, tol):
    """The steps whose loss is off by more than the tolerance: [(step, got, want)]."""
    return [(step, got, want) for step, (got, want) in enumerate(zip(losses, golden), 1)
            if abs(got - want) > tol.atol + tol.rtol * abs(want)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_match_golden(case, text_tokens, request):
    platform = platform_name()
    path = golden_path(platform, case)
    losses = run_case(case, text_tokens)
    if request.config.getoption("--update-golden"):
        write_golden(path, case, platform, losses, request.config.getoption("--golden-reason"))
        return
    if not os.path.exists(path):
        pytest.fail(f"no golden file {path}. Fix: {REGENERATE}")
    golden = read_golden(path)
    assert len(golden) == STEPS, f"{path} has {len(golden)} steps, the case runs {STEPS}"
    off = compare(losses, golden, TOLERANCES[platform])
    assert not off, (f"{case}: losses moved from {path} at (step, got, want) {off}. If the "
                     f"change is intended: {REGENERATE}")


def test_compare_catches_a_uniform_shift():
    """A shift every layout shares (what loss-falls and parity tests cannot see) fails."""
    tol = TOLERANCES["cpu_fp32"]
    golden = [6.0, 5.5, 5.0]
    assert compare(golden, golden, tol) == []
    shifted = [loss + 2 * tol.atol for loss in golden]
    assert [step for step, _, _ in compare(shifted, golden, tol)] == [1, 2, 3]
