"""Every patch that lets unmodified Megatron-Core 0.19.2 run on a CPU build of torch: the
registry, the version guard and the one entry point, `apply_cpu_patches`.

Megatron-Core is CUDA-first: it places buffers with `torch.cuda.current_device()`, creates
CUDA streams, builds small tensors with `device="cuda"`, and compares `Tensor.type()`
strings against `torch.cuda.*Tensor` names. On a CPU-only machine (this one, and CI) we
keep the engine unmodified and bend exactly those points, in platform/ and nowhere else.

Design choices:
- One `Patch` per break point, each with the reason, the Megatron version it was written
  against, an `apply` and a `still_needed` probe. `tests/platform/test_cpu_patches.py`
  checks every probe, so a Megatron upgrade that fixes (or moves) a break point fails a
  test instead of silently carrying a stale patch.
- Each patch lives in the module of its concept and is listed here, in the order it applies:
  `torch.cuda` stand-ins (platform/cuda_stand_ins.py, only when CUDA is absent),
  `device="cuda"` factories and `Tensor.type()` names (platform/cuda_literals.py), Megatron
  functions that break on CPU tensors (platform/cpu_function_fixes.py), the RNG tracker, the
  group pool (platform/group_pool.py), the one-rank collectives
  (platform/one_rank_collectives.py), the copies that compute nothing
  (platform/cpu_copies.py), RoPE without concatenations (platform/cpu_rope.py), the
  embedding copy and the uneven all-gathers on gloo.
- `UPSTREAM_FIXES` carry Megatron-LM fixes made after 0.19.2 to bugs the stock router has
  on every platform (aux-loss bookkeeping, platform/upstream_router_fixes.py) and torch-Adam
  load repairs (platform/torch_adam_fixes.py), and the in-place expert-bias add of
  platform/expert_bias_fix.py (not fixed upstream yet); they apply with CUDA too.
- MVMOE_CPU_PATCHES_SKIP="name,name" leaves patches out, to show what breaks without them.
"""

from __future__ import annotations

import os
import warnings
from typing import List

import torch

from megatron_mvmoe.platform import (cpu_copies, cpu_function_fixes, cpu_rope, cuda_literals,
                                     cuda_stand_ins, expert_bias_fix, group_pool,
                                     megatron_fsdp_cpu, one_rank_collectives, torch_adam_fixes,
                                     upstream_router_fixes)
from megatron_mvmoe.platform.cpu_embedding_copy import embedding_copy_breaks, embedding_copy_on_cpu
from megatron_mvmoe.platform.cpu_rng_tracker import cpu_rng_tracker, rng_tracker_breaks
from megatron_mvmoe.platform.cpu_uneven_gather import (layer_wise_gather_breaks,
                                                       layer_wise_gather_on_gloo,
                                                       uneven_gather_breaks, uneven_gather_on_gloo)
from megatron_mvmoe.platform.patch import Patch

MEGATRON_VERSION_PATCHED = "0.19.2"
_APPLIED_MARK = "_mvmoe_cpu_patches_applied"


PATCHES: List[Patch] = [
    cuda_stand_ins.TORCH_CUDA_STAND_INS,
    cuda_literals.CUDA_FACTORIES,
    cuda_literals.CUDA_TYPE_NAMES,
    Patch("CUDA RNG tracker",
          "model_parallel_cuda_manual_seed / get_cuda_rng_tracker().fork() read and set "
          "CUDA generator states (dot_product_attention forks it on every forward).",
          cpu_rng_tracker, rng_tracker_breaks),
    torch_adam_fixes.STATES_MISSING_FROM_CHECKPOINT,
    group_pool.POOLED_GROUPS,
    one_rank_collectives.ONE_RANK_COLLECTIVES,
    *cpu_copies.CPU_COPIES,
    *cpu_rope.CPU_ROPE,
    *megatron_fsdp_cpu.MEGATRON_FSDP_ON_CPU,
    cpu_function_fixes.INDICES_CONVERTER,
    cpu_function_fixes.CHECKPOINT_FP8_FLAG,
    cpu_function_fixes.SPLIT_SIZES,
    cpu_function_fixes.CP_ROPE_SLICE,
    Patch("last stage's embedding copy",
          "LanguageModule.setup_embeddings_and_output_layer moves the last stage's copy of "
          "the word embedding (tied embeddings or MTP at PP > 1) with .cuda().",
          embedding_copy_on_cpu, embedding_copy_breaks),
    Patch("uneven all-gather on gloo",
          "_gather_along_first_dim all-gathers unequal token counts (the alltoall "
          "dispatcher at ETP > 1 with EP) as a list, which gloo refuses.",
          uneven_gather_on_gloo, uneven_gather_breaks),
    Patch("layer-wise Muon's uneven all-gather on gloo",
          "LayerWiseDistributedOptimizer.allgather_params (--no-use-layer-wise-param-layout) "
          "all-gathers each rank's flattened matrices, unequal in size, which gloo refuses.",
          layer_wise_gather_on_gloo, layer_wise_gather_breaks),
]

# Upstream fixes of 0.19.2 bugs, applied on every platform (GPU runs included).
UPSTREAM_FIXES: List[Patch] = [
    *torch_adam_fixes.EVERY_PLATFORM,
    *upstream_router_fixes.ROUTER_FIXES,
    *expert_bias_fix.EXPERT_BIAS_FIXES,
]

ALL_PATCHES: List[Patch] = UPSTREAM_FIXES + PATCHES
SKIP_ENV = "MVMOE_CPU_PATCHES_SKIP"
_FIXES_APPLIED_MARK = "_mvmoe_upstream_fixes_applied"


def installed_megatron_version() -> str:
    """megatron-core's release (`__shortversion__`): `__version__` gains a `+<commit>` suffix
    whenever the package directory sits inside any git work tree (a venv in a checkout)."""
    import megatron.core.package_info as info

    return info.__shortversion__


def check_megatron_version() -> None:
    found = installed_megatron_version()
    if found != MEGATRON_VERSION_PATCHED:
        raise RuntimeError(
            f"megatron_mvmoe's CPU patches were written for megatron-core "
            f"{MEGATRON_VERSION_PATCHED}, found {found}. Fix: install "
            f"megatron-core=={MEGATRON_VERSION_PATCHED} (pinned in setup.py), or re-verify "
            f"each patch in megatron_mvmoe/platform/cpu_patches.py against the new version.")


def _skipped() -> List[str]:
    """Patch names listed in MVMOE_CPU_PATCHES_SKIP (comma-separated): left out, to show
    what breaks without them (tests, tools/megatron_moe_tests.py --skip-patch)."""
    names = [n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()]
    known = {p.name for p in ALL_PATCHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{SKIP_ENV}: no patch named {unknown[0]!r}. Fix: use names from "
                         f"megatron_mvmoe.platform.cpu_patches.ALL_PATCHES: {sorted(known)}")
    return names


def _apply(patches: List[Patch], skip: List[str]) -> List[str]:
    applied = []
    for patch in patches:
        if patch.name in skip:
            warnings.warn(f"{SKIP_ENV}: Megatron patch {patch.name!r} left out")
            continue
        patch.apply()
        applied.append(patch.name)
    return applied


def apply_cpu_patches() -> List[str]:
    """Apply the upstream fixes (every platform) and, without CUDA, every CPU patch, once
    each (idempotent). Returns the names applied now.

    With CUDA only the upstream fixes apply: GPU runs otherwise use Megatron-Core unmodified.
    """
    applied: List[str] = []
    if not getattr(torch, _FIXES_APPLIED_MARK, False):
        check_megatron_version()
        applied += _apply(UPSTREAM_FIXES, _skipped())
        setattr(torch, _FIXES_APPLIED_MARK, True)
    if torch.cuda.is_available() or getattr(torch, _APPLIED_MARK, False):
        return applied
    applied += _apply(PATCHES, _skipped())
    setattr(torch, _APPLIED_MARK, True)
    return applied
