"""tools/bench_kernels.py runs on CPU, reports the kernel as not timed, and counts bytes."""
import importlib.util
import json
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_kernels.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_json_report(capsys):
    tool = _tool()
    assert tool.main(["--tokens", "32", "--experts", "8", "--topk", "2", "--latent", "16",
                      "--iters", "1", "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["op"], r["phase"]): r for r in report["results"]}
    assert set(rows) == {(op, phase) for op in ("fused_multi_router", "mix_and_permute")
                         for phase in ("fwd", "fwd+bwd")}
    if report["device"] == "cpu":
        assert all(r["kernel_status"] == tool.NO_GPU and r["kernel_ms"] is None
                   for r in rows.values())
    assert all(r["reference_ms"] > 0 for r in rows.values())


def test_min_bytes_hand_count():
    tool = _tool()
    # T=2, R=2, S=1, L=4, fp32: views 64 + mix 16 + row map 16 + rows 32 bytes
    assert tool.min_bytes_mix(2, 2, 1, 4, 4)["fwd"] == 64 + 16 + 16 + 32


def test_rejects_bad_arguments():
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.parse_args(["--topk", "9", "--experts", "8"])
