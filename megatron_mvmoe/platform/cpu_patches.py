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
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Callable, List

import numpy as np
import torch

MEGATRON_VERSION_PATCHED = "0.19.2"
_APPLIED_MARK = "_mvmoe_cpu_patches_applied"


@dataclass(frozen=True)
class Patch:
    """One CPU patch of Megatron-Core (or of torch.cuda as Megatron uses it)."""

    name: str
    reason: str
    apply: Callable[[], None]
    still_needed: Callable[[], bool]
    """True while unpatched Megatron/torch still breaks at this point on CPU."""


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


# ------------------------------------------------------------ RNG tracker on CPU
def _cpu_rng_tracker() -> None:
    """The CUDA RNG tracker (used by attention/dropout forks) saves, reseeds and restores
    the CPU generator, so weight init and forks follow the same order as on a GPU."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))


def _rng_tracker_breaks() -> bool:
    """Unpatched, setting a state is deferred to a CUDA init that never comes (a silent
    no-op), so the tracker would never restore the generator after a fork."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    state = torch.get_rng_state()
    torch.rand(1)
    try:
        random._set_cuda_rng_state(state)
    except (AssertionError, RuntimeError, AttributeError):
        return True
    restored = torch.equal(torch.get_rng_state(), state)
    torch.set_rng_state(state)
    return not restored


# ------------------------------------------------- optimizer state on the torch-Adam path
def _keep_states_missing_from_checkpoint() -> None:
    """Without apex/TE the optimizer is torch's Adam, whose per-parameter state also holds
    `step`; the fully_reshardable checkpoint carries only param/exp_avg/exp_avg_sq, and
    `_set_main_param_and_optimizer_states` copies every destination key (KeyError 'step').
    Keys the checkpoint lacks keep their current value (the trainer restores the step)."""
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = module.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            current = self._get_main_param_and_optimizer_states(model_param)
            tensors = {**{k: v for k, v in current.items() if k not in tensors}, **tensors}
        return original(self, model_param, tensors)

    set_states._mvmoe_wrapped = True
    cls._set_main_param_and_optimizer_states = set_states


def _optimizer_states_break() -> bool:
    import inspect

    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    fn = module.DistributedOptimizer._set_main_param_and_optimizer_states
    return (not getattr(fn, "_mvmoe_wrapped", False)
            and "for key in dst_tensors" in inspect.getsource(fn))


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


# ------------------------------------------- process groups left alive on teardown
def _destroy_model_parallel_groups() -> None:
    """`destroy_model_parallel` only forgets most groups (it destroys the three *_GLOO
    ones): on CPU every subgroup is a gloo group holding its own threads and sockets, so a
    long-lived process that re-initialises parallel state (a test session, a sweep, an
    evaluation server) gains ~30 threads per cycle until it stalls. Destroy every group
    Megatron created (`create_group` records them in `_global_process_group_list`)."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    original = parallel_state.destroy_model_parallel

    @functools.wraps(original)
    def destroy_model_parallel():
        created = [g for g in (parallel_state._global_process_group_list or []) if g is not None]
        original()
        live = torch.distributed.distributed_c10d._world.pg_map
        for group in created:
            if group in live:
                torch.distributed.destroy_process_group(group)

    destroy_model_parallel._mvmoe_wrapped = True
    parallel_state.destroy_model_parallel = destroy_model_parallel


def _groups_outlive_destroy() -> bool:
    """Builds Megatron's groups on a one-rank gloo world of its own (only when none is
    initialised) and checks whether destroy_model_parallel leaves any alive."""
    import tempfile

    parallel_state = importlib.import_module("megatron.core.parallel_state")
    if getattr(parallel_state.destroy_model_parallel, "_mvmoe_wrapped", False):
        if torch.distributed.is_initialized():
            return False
    if torch.distributed.is_initialized():
        return True  # cannot probe without disturbing the caller's groups: assume unfixed
    store = tempfile.NamedTemporaryFile(prefix="mvmoe_pg_probe_", delete=False).name
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        parallel_state.destroy_model_parallel()
        return len(torch.distributed.distributed_c10d._world.pg_map) > 1
    finally:
        torch.distributed.destroy_process_group()


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


def _cpu_indices_to_multihot() -> None:
    """The flex dispatcher's `fused_indices_to_multihot` allocates with device='cuda' and
    launches a Triton kernel: on CPU tensors the torch equivalent runs instead."""
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = dispatcher.fused_indices_to_multihot

    @functools.wraps(original)
    def indices_to_multihot(indices, probs_indices, num_of_local_experts):
        if indices.is_cuda:
            return original(indices, probs_indices, num_of_local_experts)
        return _indices_to_multihot_torch(indices, probs_indices, num_of_local_experts)

    indices_to_multihot._mvmoe_wrapped = True
    dispatcher.fused_indices_to_multihot = indices_to_multihot


def _indices_to_multihot_breaks() -> bool:
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    try:
        dispatcher.fused_indices_to_multihot(torch.zeros(1, 1, dtype=torch.int32),
                                             torch.ones(1, 1), 2)
        return False
    except Exception:  # noqa: BLE001 - CUDA assert, Triton launch error: all mean "breaks"
        return True


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
          _cpu_rng_tracker, _rng_tracker_breaks),
    Patch("optimizer states missing from a checkpoint",
          "loading a fully_reshardable optimizer checkpoint into torch's Adam (no apex/TE) "
          "fails with KeyError 'step' in _set_main_param_and_optimizer_states.",
          _keep_states_missing_from_checkpoint, _optimizer_states_break),
    Patch("model-parallel groups destroyed",
          "destroy_model_parallel forgets its (gloo on CPU) subgroups without destroying "
          "them: a process that re-initialises parallel state leaks threads until it stalls.",
          _destroy_model_parallel_groups, _groups_outlive_destroy),
    Patch("fused_indices_to_multihot on CPU",
          "the flex dispatcher's indices converter allocates on device='cuda' and launches "
          "a Triton kernel.",
          _cpu_indices_to_multihot, _indices_to_multihot_breaks),
    Patch("alltoall split sizes",
          "maybe_move_tensor_to_cpu returns numpy only for CUDA tensors; gloo "
          "all_to_all_single rejects CPU tensors as split sizes.",
          _numpy_split_sizes, _split_sizes_break),
]


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


def apply_cpu_patches() -> List[str]:
    """Apply every CPU patch once (idempotent). Returns the names applied now.

    A no-op when CUDA is available: GPU runs use Megatron-Core unmodified.
    """
    if torch.cuda.is_available() or getattr(torch, _APPLIED_MARK, False):
        return []
    check_megatron_version()
    applied = []
    for patch in PATCHES:
        patch.apply()
        applied.append(patch.name)
    setattr(torch, _APPLIED_MARK, True)
    return applied
