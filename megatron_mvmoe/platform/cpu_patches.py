"""Every patch that lets unmodified Megatron-Core 0.19.2 run on a CPU build of torch.

Megatron-Core is CUDA-first: it places buffers with `torch.cuda.current_device()`, creates
CUDA streams, builds small tensors with `device="cuda"`, and compares `Tensor.type()`
strings against `torch.cuda.*Tensor` names. On a CPU-only machine (this one, and CI) we
keep the engine unmodified and bend exactly those points, here and nowhere else.

Design choices:
- One `Patch` per break point, each with the reason, the Megatron version it was written
  against, an `apply` and a `still_needed` probe. `tests/platform/test_cpu_patches.py`
  checks every probe, so a Megatron upgrade that fixes (or moves) a break point fails a
  test instead of silently carrying a stale patch.
- `torch.cuda.*` is shimmed with CPU stand-ins only when CUDA is absent: streams and events
  are no-ops (CPU kernels run synchronously), `current_device()` answers "cpu" so that
  `device=torch.cuda.current_device()` places tensors on the CPU, and `device_count()`
  answers 1 so seed set-up behaves like a one-GPU host.
- `device="cuda"` factory calls are redirected only inside the Megatron modules known to
  make them, through a module-local proxy of `torch`; the real `torch` is never changed
  for other code.
- `Tensor.type()` reports the CUDA type name only while the distributed optimizer and the
  gradient-clipping helpers run (they dispatch on those names).
- A patched function is replaced where it is defined AND in every module that imported it
  by name (`patch.rebind`), and its probe calls it through both: patching only an importer left
  Megatron's own callers (and its tests) on the original.
- `UPSTREAM_FIXES` carry Megatron-LM fixes made after 0.19.2 to bugs the stock router has
  on every platform (aux-loss bookkeeping, platform/upstream_router_fixes.py) and torch-Adam
  load repairs (platform/torch_adam_fixes.py), and the in-place expert-bias add of
  platform/expert_bias_fix.py (not fixed upstream yet); they apply with CUDA too. The group pool
  (platform/group_pool.py), the one-rank collectives (platform/one_rank_collectives.py) and
  the copies that compute nothing (platform/cpu_copies.py) and RoPE without concatenations
  (platform/cpu_rope.py) are CPU patches in own modules.
- MVMOE_CPU_PATCHES_SKIP="name,name" leaves patches out, to show what breaks without them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from typing import List

import numpy as np
import torch

from megatron_mvmoe.platform import (cpu_copies, cpu_rope, expert_bias_fix, group_pool,
                                     one_rank_collectives, torch_adam_fixes,
                                     upstream_router_fixes)
from megatron_mvmoe.platform.cpu_embedding_copy import embedding_copy_breaks, embedding_copy_on_cpu
from megatron_mvmoe.platform.cpu_rng_tracker import cpu_rng_tracker, rng_tracker_breaks
from megatron_mvmoe.platform.cpu_uneven_gather import (layer_wise_gather_breaks,
                                                       layer_wise_gather_on_gloo,
                                                       uneven_gather_breaks, uneven_gather_on_gloo)
from megatron_mvmoe.platform.patch import Patch, rebind

MEGATRON_VERSION_PATCHED = "0.19.2"
_APPLIED_MARK = "_mvmoe_cpu_patches_applied"


# ---------------------------------------------------------------- torch.cuda stand-ins
class _CpuStream:
    """A CUDA stream stand-in: CPU kernels are synchronous, so ordering is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """A CUDA event stand-in (recorded work on CPU is always complete)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _shim_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 1
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.set_rng_state = cuda.set_rng_state
    # The "CUDA" generator Megatron seeds and forks is the CPU generator here.
    # (torch.manual_seed itself calls cuda.manual_seed_all, so that one stays a no-op.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.empty_cache = lambda: None
    # the CUDA build of torch (PyPI's only cp312 wheel) raises "driver insufficient" here
    cuda.is_current_stream_capturing = lambda: False
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None


def _torch_cuda_breaks() -> bool:
    try:
        torch.empty(1, device=torch.cuda.current_device())
        torch.cuda.Stream()
        torch.cuda.is_current_stream_capturing()  # Megatron's router trace hook asks
        return False
    except (AssertionError, RuntimeError):
        return True


# ------------------------------------------------------ device="cuda" inside Megatron
def _to_cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and "cuda" in str(device):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _CpuTorchProxy:
    """`torch` as seen by one Megatron module: factories map device='cuda' to the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "empty_like")

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_call_on_cpu, attr)
        return attr


def _call_on_cpu(factory, *args, **kwargs):
    return factory(*args, **_to_cpu_device(kwargs))


# Megatron modules that build tensors with a literal device="cuda" on paths we use.
_CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex/TE)
    # 0.19.2: the saver's cached-metadata reuse check (async saves with a constant
    # structure) and the fully-parallel load's exchange buffers
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    # 0.19.2: layer-wise Muon's grad-norm-group flag (has_grad_norm_group), issue 36
    "megatron.core.optimizer.layer_wise_optimizer",
)


def _redirect_cuda_factories() -> None:
    for module_name in _CUDA_FACTORY_MODULES:
        module = importlib.import_module(module_name)
        module.torch = _CpuTorchProxy()


def _cuda_factories_break() -> bool:
    for module_name in _CUDA_FACTORY_MODULES:
        module_torch = importlib.import_module(module_name).torch
        try:
            module_torch.zeros(1, device="cuda")
        except (AssertionError, RuntimeError):
            return True
    return False


# -------------------------------------------------- Tensor.type() string comparisons
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    """While active, CPU float tensors report their CUDA type name from `.type()`."""
    original = torch.Tensor.type

    def type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._mvmoe_wrapped = True
    return wrapper


_TYPE_NAME_FUNCTIONS = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
     "_build_model_and_main_param_groups"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
)


def _wrap_type_name_functions() -> None:
    for module_name, class_name, method in _TYPE_NAME_FUNCTIONS:
        cls = getattr(importlib.import_module(module_name), class_name)
        fn = cls.__dict__[method]
        if isinstance(fn, (staticmethod, classmethod)):  # rewrap the same descriptor kind
            setattr(cls, method, type(fn)(_with_cuda_type_names(fn.__func__)))
        else:
            setattr(cls, method, _with_cuda_type_names(fn))
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32)
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def _type_names_break() -> bool:
    """Needed while Megatron still compares CUDA type names in a method we have not
    wrapped yet."""
    import inspect

    for module_name, class_name, method in _TYPE_NAME_FUNCTIONS:
        fn = getattr(importlib.import_module(module_name), class_name).__dict__[method]
        fn = getattr(fn, "__func__", fn)
        if getattr(fn, "_mvmoe_wrapped", False):
            continue
        if "torch.cuda." in inspect.getsource(fn) and "Tensor" in inspect.getsource(fn):
            return True
    return False


# ------------------------------------------------------------ MoE-specific patches
def _numpy_split_sizes() -> None:
    """The alltoall dispatcher converts split sizes to numpy only for CUDA tensors;
    gloo's all_to_all_single needs plain sizes, so convert CPU tensors too."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _split_sizes_break() -> bool:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    out = moe_utils.maybe_move_tensor_to_cpu(torch.zeros(2), as_numpy=True)
    return not isinstance(out, np.ndarray)


# ------------------------------------------------- flex dispatcher's indices converter
def _indices_to_multihot_torch(indices_TK, probs_TK, num_local_experts: int):
    """Pure-torch `fused_indices_to_multihot`: indices [T, k] (-1 or >= num_local_experts
    = not local) -> (routing map [T, n] bool, probs [T, n]), differentiable in probs."""
    valid_TK = (indices_TK >= 0) & (indices_TK < num_local_experts)
    safe_TK = torch.where(valid_TK, indices_TK, torch.zeros_like(indices_TK)).long()
    shape = (indices_TK.shape[0], num_local_experts)
    hits = torch.zeros(shape, dtype=torch.int32, device=indices_TK.device)
    hits = hits.scatter_add(1, safe_TK, valid_TK.int())
    probs = torch.zeros(shape, dtype=probs_TK.dtype, device=probs_TK.device)
    probs = probs.scatter_add(1, safe_TK, probs_TK * valid_TK)
    return hits > 0, probs


_INDICES_CONVERTER = "megatron.core.fusions.fused_indices_converter"
# Modules that import `fused_indices_to_multihot` by name (their binding is rebound too).
_INDICES_CONVERTER_USERS = ("megatron.core.transformer.moe.token_dispatcher",)


def _cpu_indices_to_multihot() -> None:
    """The flex dispatcher's `fused_indices_to_multihot` allocates with device='cuda' and
    launches a Triton kernel: on CPU tensors the torch equivalent runs instead."""
    original = importlib.import_module(_INDICES_CONVERTER).fused_indices_to_multihot

    @functools.wraps(original)
    def indices_to_multihot(indices, probs_indices, num_of_local_experts):
        if indices.is_cuda:
            return original(indices, probs_indices, num_of_local_experts)
        return _indices_to_multihot_torch(indices, probs_indices, num_of_local_experts)

    indices_to_multihot._mvmoe_wrapped = True
    rebind(_INDICES_CONVERTER, "fused_indices_to_multihot", indices_to_multihot,
            _INDICES_CONVERTER_USERS)


def _indices_to_multihot_breaks() -> bool:
    """Calls the converter as its source module and each importer see it."""
    for module_name in (_INDICES_CONVERTER, *_INDICES_CONVERTER_USERS):
        convert = importlib.import_module(module_name).fused_indices_to_multihot
        try:
            convert(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), 2)
        except Exception:  # noqa: BLE001 - CUDA assert, Triton launch error: all mean "breaks"
            return True
    return False


# ---------------------------------------------------- RoPE table slice per CP rank
_ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
_ROPE_UTILS_USERS = ("megatron.core.models.common.embeddings.rotary_pos_embedding",
                     "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


def _cp_rope_slice_on_cpu() -> None:
    """`get_pos_emb_on_this_cp_rank` builds its chunk index with pin_memory=True and
    .cuda(): on a CPU table the index stays on the table's device (same chunks)."""
    original = importlib.import_module(_ROPE_UTILS).get_pos_emb_on_this_cp_rank

    @functools.wraps(original)
    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if pos_emb.is_cuda or cp_group is None:
            return original(pos_emb, seq_dim, cp_group)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1,
                               *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    pos_emb_on_this_cp_rank._mvmoe_wrapped = True
    rebind(_ROPE_UTILS, "get_pos_emb_on_this_cp_rank", pos_emb_on_this_cp_rank,
            _ROPE_UTILS_USERS)


class _TwoRankGroupStandIn:
    """size()/rank() of rank 0 of a 2-rank group: all the slice reads of its group."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def _cp_rope_slice_breaks() -> bool:
    """Calls the slice as its source module and each importer see it."""
    for module_name in (_ROPE_UTILS, *_ROPE_UTILS_USERS):
        slice_for_rank = importlib.import_module(module_name).get_pos_emb_on_this_cp_rank
        try:
            out = slice_for_rank(torch.arange(8.0)[:, None], 0, _TwoRankGroupStandIn())
        except Exception:  # noqa: BLE001 - pin_memory / CUDA init errors all mean "breaks"
            return True
        if out.reshape(-1).tolist() != [0.0, 1.0, 6.0, 7.0]:
            return True
    return False


_RANDOM = "megatron.core.tensor_parallel.random"


def _checkpoint_without_output_fp8_flag() -> None:
    """`CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not None`, True
    for its own default, so every recompute of a norm, an MoE activation or MLA's up
    projection takes the fp8 branch and calls TransformerEngine's FP8GlobalStateManager
    (never imported without TE: NameError). The argument means "a quantization recipe
    is set" (callers pass config.fp8, a string or None): False and None both mean none."""
    cls = importlib.import_module(_RANDOM).CheckpointWithoutOutput
    original_init = cls.__init__

    def __init__(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = fp8 not in (None, False)

    __init__._mvmoe_wrapped = True
    cls.__init__ = __init__


def _checkpoint_without_output_fp8_breaks() -> bool:
    cls = importlib.import_module(_RANDOM).CheckpointWithoutOutput
    return cls().fp8 and not hasattr(importlib.import_module(_RANDOM), "FP8GlobalStateManager")


PATCHES: List[Patch] = [
    Patch("torch.cuda stand-ins",
          "Megatron calls torch.cuda.current_device/Stream/current_stream/synchronize/"
          "get_rng_state/is_current_stream_capturing and nvtx directly (router, experts, "
          "dispatcher, p2p, random, router trace).",
          _shim_torch_cuda, _torch_cuda_breaks),
    Patch("device='cuda' factories",
          "schedules, clip_grads, optimizer, grad_scaler, transformer.utils, rerun state, "
          "the checkpoint saver's reuse check and the load exchange build tensors with a "
          "literal device='cuda'.",
          _redirect_cuda_factories, _cuda_factories_break),
    Patch("Tensor.type() names",
          "The distributed optimizer, the fp16 optimizer and grad clipping dispatch on "
          "'torch.cuda.*Tensor' strings.",
          _wrap_type_name_functions, _type_names_break),
    Patch("CUDA RNG tracker",
          "model_parallel_cuda_manual_seed / get_cuda_rng_tracker().fork() read and set "
          "CUDA generator states (dot_product_attention forks it on every forward).",
          cpu_rng_tracker, rng_tracker_breaks),
    torch_adam_fixes.STATES_MISSING_FROM_CHECKPOINT,
    group_pool.POOLED_GROUPS,
    one_rank_collectives.ONE_RANK_COLLECTIVES,
    *cpu_copies.CPU_COPIES,
    *cpu_rope.CPU_ROPE,
    Patch("fused_indices_to_multihot on CPU",
          "fusions.fused_indices_converter (imported by the flex dispatcher and by callers "
          "of the fusion) allocates on device='cuda' and launches a Triton kernel.",
          _cpu_indices_to_multihot, _indices_to_multihot_breaks),
    Patch("CheckpointWithoutOutput fp8 flag",
          "CheckpointWithoutOutput() (norm, moe_act and MLA up-projection recompute) sets "
          "fp8=True for its default fp8=False and then needs TransformerEngine's "
          "FP8GlobalStateManager: NameError without TE.",
          _checkpoint_without_output_fp8_flag, _checkpoint_without_output_fp8_breaks),
    Patch("alltoall split sizes",
          "maybe_move_tensor_to_cpu returns numpy only for CUDA tensors; gloo "
          "all_to_all_single rejects CPU tensors as split sizes.",
          _numpy_split_sizes, _split_sizes_break),
    Patch("RoPE slice per CP rank",
          "rope_utils.get_pos_emb_on_this_cp_rank (RotaryEmbedding at CP > 1) builds its "
          "chunk index with pin_memory=True and .cuda().",
          _cp_rope_slice_on_cpu, _cp_rope_slice_breaks),
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
