"""What a run records about itself: the start-up banner, versions + git commit, the resolved
config, and the efficiency figures of each progress line (MFU, peak memory, ETA).

Design choices:
- MFU = achieved model FLOP/s / peak FLOP/s of the ranks. Model FLOPs are the planner's
  analytic training count (`config.model_costs.flops_per_token`: 3 x forward, active parameters
  only, attention scores included), so MFU compares variants by the work they are meant
  to do, not by what a kernel happens to spend. The peak is the datasheet dense bf16 peak
  for known GPUs, else the measured fp32/bf16 matmul rate of this process (on CPU: with
  its own thread count, the figure the run can actually reach): the best of several
  trials, and never below a plausible floor (a start-up hiccup once measured 1.0 GFLOP/s
  where 102 was right, and MFU read 490-722%). Below the floor the floor is used and the
  banner says so; if the run then beats its peak, the peak is re-measured (or raised to
  the achieved rate) and the progress line says so: MFU never exceeds 100% silently.
- Peak memory: on GPU torch's max allocated; on CPU the process's peak resident set
  (getrusage), which includes Python and the data pipeline: an upper bound. The log line
  shows the maximum over ranks.
- versions.json: python, torch, megatron-core, numpy, triton, this package and its git commit
  (plus whether the tree had uncommitted changes), host, world size, the command line.
- config.yaml holds the resolved model (every preset field filled in), and still loads.
"""

from __future__ import annotations

import json
import os
import platform as py_platform
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from megatron_mvmoe import platform
from megatron_mvmoe.training.adam_impl import adam_impl_line

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from NVIDIA's datasheets.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12,
                 "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
                 "GB200": 2500e12, "B200": 2250e12}


PLAUSIBLE_FLOPS_PER_CPU_THREAD = 4e9
"""Floor for a measured CPU peak: one 4-lane fp32 multiply-add per cycle at 2 GHz, at half
efficiency; any x86-64 / Arm64 core of the last 15 years measures more (sgemm)."""
PLAUSIBLE_GPU_FLOPS = 1e12
"""Floor for a measured GPU peak (a GPU missing from GPU_PEAK_BF16): far below any bf16
tensor-core part."""
PEAK_TRIALS = 3


def measured_matmul_peak(dtype: torch.dtype = torch.float32, size: int = 512,
                         seconds: float = 0.3) -> float:
    """FLOP/s of a square matmul on this process's device (best of repeated timings)."""
    from megatron_mvmoe import platform

    device = platform.device()
    # A private generator: measuring must not move the run's RNG (seeded, checkpointed).
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    b = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        platform.synchronize()
        best = max(best, 4 * 2 * size ** 3 / max(time.perf_counter() - start, 1e-9))
    return best


def plausible_floor() -> float:
    """The lowest believable peak of one rank on this device."""
    if platform.is_cuda():
        return PLAUSIBLE_GPU_FLOPS
    return PLAUSIBLE_FLOPS_PER_CPU_THREAD * torch.get_num_threads()


def checked_peak(measure: Callable[[], float], floor: float, what: str,
                 trials: int = PEAK_TRIALS) -> Dict[str, object]:
    """The best of `trials` calls of `measure` (FLOP/s), or `floor` when even the best is
    below it, with a source line saying which."""
    best = max(measure() for _ in range(max(1, trials)))
    if best >= floor:
        return {"flops": best, "source": f"measured {what}, best of {trials}"}
    return {"flops": floor, "source": f"plausible floor: measured {what} gave only "
                                      f"{best / 1e9:.1f} GFLOP/s (best of {trials}), below "
                                      f"the floor {floor / 1e9:.1f}; MFU is an upper bound"}


def device_peak_flops(use_bf16: bool, measure: Optional[Callable[[], float]] = None
                      ) -> Dict[str, object]:
    """{'flops': peak FLOP/s of one rank, 'source': 'datasheet <name>' | 'measured ...' |
    'plausible floor ...'}. `measure` replaces the matmul timing (tests inject a slow one)."""
    if platform.is_cuda():
        name = platform.device_name()
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return {"flops": peak, "source": f"datasheet {key} bf16 dense"}
    dtype = torch.bfloat16 if use_bf16 and platform.is_cuda() else torch.float32
    what = f"{str(dtype).split('.')[-1]} matmul, {torch.get_num_threads()} threads"
    return checked_peak(measure or (lambda: measured_matmul_peak(dtype)), plausible_floor(),
                        what)


def peak_memory_bytes() -> int:
    return platform.peak_memory_bytes()


def mfu(tokens_per_s: float, flops_per_token: float, peak_per_rank: float,
        world_size: int) -> float:
    return tokens_per_s * flops_per_token / max(peak_per_rank * world_size, 1e-9)


def eta_seconds(steps_left: int, seconds_per_step: float) -> float:
    return max(0, steps_left) * seconds_per_step


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _git_commit() -> Dict[str, object]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(dirty) if commit else None}


def _version(module: str) -> Optional[str]:
    try:
        return getattr(__import__(module, fromlist=["__version__"]), "__version__", None)
    except Exception:  # an optional package that is absent or broken is simply unlisted
        return None


def versions(world_size: int) -> Dict[str, object]:
    import numpy

    from megatron_mvmoe.platform.cpu_patches import installed_megatron_version

    return {"python": py_platform.python_version(), "torch": torch.__version__,
            "megatron_core": installed_megatron_version(), "numpy": numpy.__version__,
            "triton": _version("triton"), "megatron_mvmoe": _version("megatron_mvmoe"),
            "git": _git_commit(), "host": socket.gethostname(),
            "cuda": platform.cuda_version(), "device": platform.device_name(),
            "world_size": world_size, "argv": sys.argv}


def banner(run, model, counts: Dict[str, int], world_size: int, peak: Dict,
           info: Dict) -> str:
    """The start-up block: model, parameters, layout, batch, versions."""
    p, t = run.parallel, run.training
    dp = p.layout().data_parallel_size(world_size)
    git = info.get("git") or {}
    lines = [
        "=" * 72,
        f"megatron_mvmoe | {model.moe_variant} | {model.num_layers} layers, D={model.hidden_size}"
        f", heads={model.num_attention_heads}, seq={model.seq_length}, vocab={model.vocab_size}",
        f"parameters: total {counts['total'] / 1e6:.2f} M, active {counts['active'] / 1e6:.2f} M"
        f" per token" + (f", {model.num_experts} experts top-{model.moe_router_topk}"
                         if model.is_moe else ""),
        f"layout: world {world_size} = TP {p.tp} x PP {p.pp}"
        + (f" x CP {p.cp}" if p.cp > 1 else "") + f" x DP {dp}; EP {p.ep}, ETP {p.etp}"
        + (f", VPP {p.vpp}" if p.vpp else ""),
        f"batch: global {t.global_batch_size} x {model.seq_length} tokens, micro "
        f"{t.micro_batch_size}, {t.train_iters} steps, precision {t.precision}",
        f"peak for MFU: {peak['flops'] / 1e9:.1f} GFLOP/s per rank ({peak['source']})",
        *_fast_path_lines(run),
        *filter(None, [adam_impl_line(run.optimizer.torch_adam_impl)]),
        f"versions: python {info['python']}, torch {info['torch']}, megatron-core "
        f"{info['megatron_core']}, commit {str(git.get('commit'))[:12]}"
        + (" (uncommitted changes)" if git.get("dirty") else ""),
        "=" * 72]
    return "\n".join(lines)


def _fast_path_lines(run) -> List[str]:
    """Which core attention and fusions this run builds (the provider's fast-path rule,
    same inputs)."""
    from megatron_mvmoe.models.fast_paths import attention_line, fusions_line
    from megatron_mvmoe.training.build import run_fast_paths

    paths = run_fast_paths(run)
    return [attention_line(paths), fusions_line(paths)]


class Efficiency:
    """MFU, peak memory and ETA for the progress lines of one run (every rank calls
    `figures`: the peak memory is reduced with MAX over all ranks)."""

    def __init__(self, run, model, world_size: int, use_bf16: bool,
                 measure: Optional[Callable[[], float]] = None) -> None:
        from megatron_mvmoe.config.model_costs import flops_per_token, parameter_counts

        self.world_size = world_size
        self.train_iters = run.training.train_iters
        self.flops_per_token = flops_per_token(model)["train"]
        self.counts = parameter_counts(model)
        self.use_bf16, self.measure = use_bf16, measure
        self.peak = device_peak_flops(use_bf16, measure)

    def _mfu(self, tokens_per_s: float) -> float:
        """MFU; when the achieved rate beats the peak, the peak was wrong: re-measure it,
        and if it is still beaten, take the achieved rate as the peak (MFU 100%). Either
        way `peak['revised']` says what happened, for the progress line."""
        value = mfu(tokens_per_s, self.flops_per_token, self.peak["flops"], self.world_size)
        if value <= 1.0:
            return value
        before = self.peak["flops"]
        peak = device_peak_flops(self.use_bf16, self.measure)
        achieved = tokens_per_s * self.flops_per_token / self.world_size
        if peak["flops"] < achieved:
            peak = {"flops": achieved, "source": "the achieved rate (re-measured peak "
                                                 f"{peak['flops'] / 1e9:.1f} GFLOP/s was lower)"}
        peak["revised"] = (f"MFU peak revised from {before / 1e9:.1f} to "
                           f"{peak['flops'] / 1e9:.1f} GFLOP/s per rank: {peak['source']}")
        self.peak = peak
        return mfu(tokens_per_s, self.flops_per_token, self.peak["flops"], self.world_size)

    def figures(self, tokens_per_s: float, seconds_per_step: float, step: int) -> Dict:
        import torch.distributed as dist

        memory = torch.tensor([float(peak_memory_bytes())], dtype=torch.float64)
        if dist.is_initialized():
            from megatron_mvmoe import platform

            memory = memory.to(platform.device())
            dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        revised_before = self.peak.get("revised")
        value = self._mfu(tokens_per_s)
        revised = self.peak.get("revised")
        return {"mfu": value, **({"mfu_peak_revised": revised}
                                 if revised and revised != revised_before else {}),
                "model_tflops_per_s": tokens_per_s * self.flops_per_token / 1e12,
                "peak_memory_gb": float(memory.item()) / 2 ** 30,
                "seconds_per_step": seconds_per_step,
                "eta_s": eta_seconds(self.train_iters - step, seconds_per_step)}

    @staticmethod
    def text(figures: Dict) -> str:
        revised = (f" ({figures['mfu_peak_revised']})" if figures.get("mfu_peak_revised")
                   else "")
        return (f" | MFU {100 * figures['mfu']:.2f}%{revised} | mem "
                f"{figures['peak_memory_gb']:.2f} GB | ETA {format_duration(figures['eta_s'])}")


def write_run_files(run_dir: Optional[str], run, model, efficiency: Efficiency,
                    world_size: int, log_line) -> None:
    """Banner on the console (and in banner.txt), versions.json and the resolved
    config.yaml in the run directory (global rank 0 only; the caller checks)."""
    import yaml

    info = versions(world_size)
    text = banner(run, model, efficiency.counts, world_size, efficiency.peak, info)
    log_line(text)
    if not run_dir:
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "versions.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    with open(os.path.join(run_dir, "banner.txt"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(run_dir, "config.yaml"), "w") as fh:
        yaml.safe_dump(run.to_dict(), fh, sort_keys=False)  # the model is resolved
