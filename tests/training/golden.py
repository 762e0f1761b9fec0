"""Golden loss files: the per-step training loss of fixed tiny runs, per platform, with a
declared tolerance (as torchtitan and Megatron-LM keep them). A change that shifts every
variant and layout alike (init, data order, an engine upgrade) fails here even though the
loss still falls and the layouts still agree with each other.

Files: tests/assets/losses/<platform>/<case>.txt, a commented header (platform, versions,
why they were last written, tolerance) then `step loss` lines. Regenerate, saying why:

    .venv/bin/python -m pytest tests/training/test_golden_losses.py --update-golden \\
        --golden-reason "what changed and why the losses moved"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "assets", "losses")
STEPS = 8
REGENERATE = ('.venv/bin/python -m pytest tests/training/test_golden_losses.py '
              '--update-golden --golden-reason "..."')


@dataclass(frozen=True)
class GoldenCase:
    preset: str
    parallel: Optional[Dict[str, int]] = None
    world: int = 1


CASES: Dict[str, GoldenCase] = {
    "dense": GoldenCase("tiny_dense"),
    "smoe": GoldenCase("tiny_smoe"),
    "latent": GoldenCase("tiny_latent"),
    "multi_router": GoldenCase("tiny_multi_router"),
    "multi_view": GoldenCase("tiny_multi_view"),
    "multi_view_ep2": GoldenCase("tiny_multi_view", {"ep": 2}, 2),
    "mh_moe": GoldenCase("tiny_mh_moe"),
}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES = {"cpu_fp32": Tolerance(atol=1e-4, rtol=0.0),
              # bf16 kernels differ between GPU generations and TE versions
              "gpu_bf16": Tolerance(atol=2e-2, rtol=0.0)}


def platform_name() -> str:
    import torch

    return "gpu_bf16" if torch.cuda.is_available() else "cpu_fp32"


def golden_path(platform: str, case: str) -> str:
    return os.path.join(ASSETS, platform, f"{case}.txt")


def read_golden(path: str) -> List[float]:
    losses = []
    for line in open(path):
        if line.startswith("#") or not line.strip() or line.startswith("step"):
            continue
        step, loss = line.split()
        assert int(step) == len(losses) + 1, f"{path}: steps must count from 1"
        losses.append(float(loss))
    return losses


def write_golden(path: str, case: str, platform: str, losses: List[float], reason: str) -> None:
    import megatron.core.package_info as mcore
    import torch

    tol = TOLERANCES[platform]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    spec = CASES[case]
    header = [f"golden losses: case {case} (tests/training/golden.py: preset {spec.preset}, "
              f"parallel {spec.parallel or {}}, {spec.world} rank(s), {STEPS} steps)",
              f"platform: {platform}; torch {torch.__version__}; megatron-core "
              f"{mcore.__shortversion__}",
              f"tolerance: atol={tol.atol} rtol={tol.rtol}",
              f"reason: {reason}",
              f"regenerate: {REGENERATE}"]
    with open(path, "w") as f:
        f.writelines(f"# {line}\n" for line in header)
        f.write("step loss\n")
        f.writelines(f"{i} {loss!r}\n" for i, loss in enumerate(losses, start=1))
