"""Ahead-of-time compilation of every Triton kernel of the package for real GPU targets, on
any machine (no GPU needed: Triton ships ptxas), and the resources read from the artefacts.

Legend: T tokens, E experts, R routing heads (= views), S slots (top-k), L latent.

Design choices:
- The calls compiled are the launchers' own KernelLaunch objects, built on meta tensors with
  device_type="cuda" (the block sizes the launchers pick on a GPU), and specialised by
  Triton's own binder for the target's backend: the signature, constexprs and alignment
  attributes are those a real launch would compile, so this cannot drift from what runs.
- Triton decides interpreted-vs-compiled when triton.language is first imported; a process
  that set TRITON_INTERPRET=1 (the CPU test session) cannot compile, so `compile_isolated`
  runs the compile in a child process without that variable.
- Sources of each figure: registers and spills from `ptxas -v` rerun on the kernel's ptx with
  Triton's own ptxas and flags (its register count is checked against Triton's own cubin
  with cuobjdump, so the figures describe that binary); shared memory is Triton's launch request
  (metadata.shared); num_warps / num_stages from the compile options.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

import torch

TARGETS: Dict[str, int] = {"sm_90": 90, "sm_100": 100}  # H100/H200, B200


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """Sizes one MoE layer's kernels see per micro-batch."""
    tokens: int  # T per micro-batch (sequence x micro-batch size)
    experts: int  # E
    topk: int  # S
    heads: int  # R routing heads = K views
    latent: int  # L


def check_targets(names: List[str]) -> None:
    """Raise ValueError naming the supported targets for an unknown one."""
    for name in names:
        if name not in TARGETS:
            raise ValueError(f"--target: unknown GPU target {name!r}. Fix: use one of "
                             f"{', '.join(TARGETS)}")


def kernel_calls(shapes: KernelShapes, dtype: torch.dtype = torch.bfloat16):
    """{name: KernelLaunch} of the four kernels as the training path calls them (bwd of the
    router: no d summed, float alpha), on meta tensors with GPU block sizes."""
    from . import fused_routing, mix_permute
    from .reference import RouterOutput

    t, e, s, r, lat = (shapes.tokens, shapes.experts, shapes.topk, shapes.heads,
                       shapes.latent)
    def meta(*size, dt=torch.float32):
        return torch.empty(*size, dtype=dt, device="meta")
    out = RouterOutput(meta(t, s, dt=torch.int64), meta(t, s), meta(t, s, r), meta(t, e))
    logits = meta(t, r, e)  # moe_router_dtype fp32
    views, rows, row_of = meta(t, r, lat, dt=dtype), meta(t * s, lat, dt=dtype), meta(
        t, s, dt=torch.int64)
    return {
        "multi_router_fwd": fused_routing.forward_launch(
            logits, meta(e), meta(e), out, 1e-6, device_type="cuda"),
        "multi_router_bwd": fused_routing.backward_launch(
            logits, meta(e), *out, meta(t, s), meta(t, s, r), None, meta(t, r, e), None, 1e-6,
            device_type="cuda"),
        "mix_permute_fwd": mix_permute.forward_launch(views, out.mix_TSR, row_of, rows,
                                                      device_type="cuda"),
        "mix_permute_bwd": mix_permute.backward_launch(
            views, out.mix_TSR, row_of, rows, meta(t, r, lat, dt=dtype), meta(t, s, r),
            device_type="cuda"),
    }


def compile_call(call, target_name: str) -> dict:
    """Compile one KernelLaunch for `target_name`; its resources as a dict."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from .backend import _decorate, interpreter_enabled

    if interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET is set: compile with compile_isolated()")
    check_targets([target_name])
    target = GPUTarget("cuda", TARGETS[target_name], 32)
    fn = _decorate(call.kernel_fn, False)
    backend = make_backend(target)
    # Triton's launch path (JITFunction.run) without a device: bind, specialise, pack.
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*call.args, **call.constexprs)
    options, signature, constexprs, attrs = fn._pack_args(backend, call.constexprs, bound,
                                                          spec, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    usage = _ptxas_usage(kernel, target.arch)
    return dict(target=target_name, constexprs=call.constexprs, grid=list(call.grid),
                num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                shared_bytes=kernel.metadata.shared, ptx_bytes=len(kernel.asm["ptx"]),
                cubin_bytes=len(kernel.asm["cubin"]), **usage)


def _ptxas_usage(kernel, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        # the flags of triton's make_cubin (-lineinfo, --regAllocOptLevel=2), -v for the log
        done = subprocess.run(
            [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", ptx, "-o", cubin],
            capture_output=True, text=True, check=True)
        with open(cubin, "rb") as f:
            same = f.read() == kernel.asm["cubin"]
        triton_regs = _cubin_registers(kernel.asm["cubin"], tmp)
    log = done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v: no register/spill lines in its log:\n{log}")
    return dict(registers=int(regs.group(1)), spill_store_bytes=int(spills.group(1)),
                spill_load_bytes=int(spills.group(2)), ptxas_cubin_identical=same,
                triton_cubin_registers=triton_regs)


def _cubin_registers(cubin: bytes, tmp: str) -> int:
    """Registers of Triton's own cubin, read with the cuobjdump Triton ships: the check that
    the ptxas rerun's figures describe the binary Triton built (the rerun's cubin need not be
    byte-identical: ptxas embeds build details that vary between runs and versions)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    path = os.path.join(tmp, "triton.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    done = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True)
    regs = re.search(r"REG:(\d+)", done.stdout)
    if regs is None:
        raise RuntimeError(f"cuobjdump -res-usage: no REG field in its output:\n{done.stdout}")
    return int(regs.group(1))


def compile_all(shapes: Dict[str, KernelShapes], targets: List[str]) -> List[dict]:
    """Every kernel x target x shape set, compiled here; one dict per compile."""
    check_targets(targets)
    rows = []
    for shape_name, shape in shapes.items():
        for kernel_name, call in kernel_calls(shape).items():
            for target in targets:
                rows.append(dict(kernel=kernel_name, shapes=shape_name,
                                 **compile_call(call, target)))
    return rows


def compile_isolated(shapes: Dict[str, KernelShapes], targets: List[str]) -> List[dict]:
    """compile_all in a child process without TRITON_INTERPRET."""
    check_targets(targets)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    request = json.dumps(dict(targets=targets,
                              shapes={k: dataclasses.asdict(v) for k, v in shapes.items()}))
    done = subprocess.run([sys.executable, "-m", "mvmoe_kernels.aot"], input=request,
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"AOT compile failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


if __name__ == "__main__":  # the child of compile_isolated: request on stdin, JSON out
    req = json.load(sys.stdin)
    print(json.dumps(compile_all({k: KernelShapes(**v) for k, v in req["shapes"].items()},
                                 req["targets"])))
