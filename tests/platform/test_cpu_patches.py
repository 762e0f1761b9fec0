"""Every CPU patch is still needed by unmodified Megatron-Core (its probe breaks without
it) and takes effect (its probe passes after apply_cpu_patches). Runs the probes in a fresh
interpreter, since the patches are process-wide once applied."""

import json
import subprocess
import sys

import pytest
import torch

PROBE = r"""
import json, warnings
warnings.filterwarnings("ignore")
from megatron_mvmoe.platform.cpu_patches import PATCHES, apply_cpu_patches
before = {p.name: p.still_needed() for p in PATCHES}
applied = apply_cpu_patches()
after = {p.name: p.still_needed() for p in PATCHES}
again = apply_cpu_patches()
print(json.dumps({"before": before, "after": after, "applied": applied, "again": again}))
"""


@pytest.fixture(scope="module")
def probe():
    if torch.cuda.is_available():
        pytest.skip("CPU patches are a no-op with CUDA")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_patch_is_still_needed(probe):
    stale = [name for name, needed in probe["before"].items() if not needed]
    assert not stale, f"Megatron no longer breaks at these points; remove the patches: {stale}"


def test_every_patch_applies(probe):
    failing = [name for name, needed in probe["after"].items() if needed]
    assert not failing, f"patches that did not take effect: {failing}"


def test_patches_are_idempotent(probe):
    assert probe["applied"] == list(probe["before"])
    assert probe["again"] == []


def test_version_guard_rejects_other_megatron(monkeypatch):
    import megatron.core

    from megatron_mvmoe.platform import cpu_patches

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1"):
        cpu_patches.check_megatron_version()


def test_cpu_stream_is_a_noop_context():
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.ones(2, device=torch.cuda.current_device())
    assert x.device.type == "cpu"


def test_layout_errors_name_the_sizes():
    from megatron_mvmoe.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"tp\*pp = 3\*1 = 3 does not divide world size 4"):
        ParallelLayout(tp=3).validate(4)
    with pytest.raises(ValueError, match="num_moe_experts 6 is not divisible by ep 4"):
        ParallelLayout(ep=4).validate(4, num_experts=6)
    with pytest.raises(ValueError, match="ep=1 with etp=1 < tp=2"):
        ParallelLayout(tp=2, etp=1).validate(2, num_experts=4)
    ParallelLayout(tp=2, etp=1).validate(2)  # no experts: nothing to reduce
    ParallelLayout(tp=2, etp=1).validate(2, num_experts=4, training=False)
    with pytest.raises(ValueError, match="num_layers 3"):
        ParallelLayout(pp=2).validate(4, num_layers=3)
