"""tools/megatron_moe_tests.py and its pieces: a synthetic Megatron-LM checkout (a git repo
made here, read at a ref with `git archive`) whose tests use `.cuda()`, `device="cuda"`,
`skipif(not torch.cuda.is_available())` and an NCCL all-reduce, run at 1 and 2 ranks through
the platform layer and the test-side adapter; the per-rank merge rule; failure causes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mvmoe.testing import megatron_suite as suite

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "megatron_moe_tests.py"

FAKE_TESTS = '''
import os

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_own_cuda_calls_stay_on_cpu():
    x = torch.ones(2, device="cuda").cuda()
    layer = torch.nn.Linear(2, 3).cuda()
    assert layer(x.to("cuda")).device.type == "cpu"


def test_nccl_all_reduce_runs_on_gloo():
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:"
                                + os.environ["MASTER_PORT"],
                                rank=int(os.environ["LOCAL_RANK"]), world_size=world_size)
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size


def test_cuda_calls_from_outside_the_tests_are_not_adapted():
    namespace = {}
    exec(compile("def to_cuda(t):\\n    return t.cuda()\\n", "/not/a/test/file.py", "exec"),
         namespace)
    with pytest.raises((AssertionError, RuntimeError)):
        namespace["to_cuda"](torch.ones(1))


def test_deliberate_failure():
    assert False, "deliberate failure"


@pytest.mark.skip(reason="deliberate skip")
def test_deliberate_skip():
    pass
'''


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def fake_megatron_lm(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fake_megatron_lm")
    moe = repo / suite.MOE_TESTS
    moe.mkdir(parents=True)
    for init in ("tests/__init__.py", "tests/unit_tests/__init__.py"):
        (repo / init).write_text("")
    script = repo / suite._NEEDED_PATHS[-1]
    script.parent.mkdir(parents=True)
    script.write_text("")
    (moe / "test_fake.py").write_text(FAKE_TESTS)
    (moe / "test_broken.py").write_text("import torch\nraise RuntimeError('at import')\n")
    _git(repo, "init", "-q", "-b", "release")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "fake")
    (moe / "test_fake.py").write_text("def test_only_in_the_work_tree():\n    pass\n")
    return repo


def test_tool_counts_a_synthetic_checkout_at_1_and_2_ranks(fake_megatron_lm):
    out = subprocess.run(
        [sys.executable, str(TOOL), "--megatron-lm-src", str(fake_megatron_lm),
         "--ref", "release", "--ranks", "1", "2", "--per-test-timeout", "60",
         "--timeout", "240", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    rows = {(os.path.basename(r["file"]), r["world_size"]): r for r in report["files"]}
    assert sorted(rows) == [("test_broken.py", 1), ("test_broken.py", 2), ("test_fake.py", 1),
                            ("test_fake.py", 2)]
    for n in (1, 2):
        fake, broken = rows[("test_fake.py", n)], rows[("test_broken.py", n)]
        assert not fake["killed"], fake  # ranks that init NCCL(gloo) and never destroy it exit
        assert (fake["passed"], fake["failed"], fake["skipped"]) == (3, 1, 1), fake
        assert list(fake["failures"].values()) == [
            "[call] AssertionError: deliberate failure"], fake
        assert (broken["passed"], broken["failed"], broken["skipped"]) == (0, 1, 0), broken
        (error,) = broken["failures"].values()
        assert error.startswith("[collect]") and "at import" in error, error
    assert report["by_ranks"]["2"]["totals"] == {"passed": 3, "failed": 2, "skipped": 1}
    # the tests were read at the ref, not from the (changed) work tree, and not into our repo
    assert not (ROOT / suite.MOE_TESTS).exists()


def test_worktree_ref_copies_the_checkout_as_it_is(fake_megatron_lm, tmp_path):
    suite.extract_tests(str(fake_megatron_lm), None, str(tmp_path))
    text = (tmp_path / suite.MOE_TESTS / "test_fake.py").read_text()
    assert "test_only_in_the_work_tree" in text
    assert (tmp_path / (suite.PLUGIN_NAME + ".py")).exists()


def test_bad_sources_are_one_line_naming_the_flag(fake_megatron_lm, tmp_path):
    with pytest.raises(ValueError, match=r"--ref 'no-such-branch'.*Fix: pass a branch"):
        suite.extract_tests(str(fake_megatron_lm), "no-such-branch", str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"--megatron-lm-src .*not a directory"):
        suite.extract_tests(str(tmp_path / "missing"), None, str(tmp_path / "b"))
    out = subprocess.run([sys.executable, str(TOOL), "--megatron-lm-src", str(tmp_path),
                          "--ref", "worktree"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: --megatron-lm-src")


def test_unknown_file_filter_names_the_choices(fake_megatron_lm, tmp_path):
    suite.extract_tests(str(fake_megatron_lm), "release", str(tmp_path))
    assert suite.test_files(str(tmp_path), ["test_fake"]) == [f"{suite.MOE_TESTS}/test_fake.py"]
    with pytest.raises(ValueError, match="--files 'test_nope.py'.*test_fake.py"):
        suite.test_files(str(tmp_path), ["test_nope.py"])


def _row(nodeid, outcome, when="call", error=""):
    return {"nodeid": nodeid, "when": when, "outcome": outcome, "error": error}


def test_merge_over_ranks():
    collected = {"collected": ["a", "b", "c", "d", "e"]}
    rank0 = [collected, _row("a", "passed"), _row("b", "passed"), _row("c", "skipped"),
             _row("d", "failed", "setup", "boom"), _row("e", "passed")]
    rank1 = [collected, _row("a", "passed"), _row("b", "failed", error="rank1 only"),
             _row("c", "skipped"), _row("d", "passed")]  # e: rank 1 killed before it
    result = suite.merge_rank_reports([rank0, rank1], "f.py", 2)
    assert (result.passed, result.failed, result.skipped) == (1, 3, 1)
    assert result.failures == {"b": "[call] rank1 only", "d": "[setup] boom",
                               "e": "no result from rank 1 (file killed at its timeout)"}
    empty = suite.merge_rank_reports([[], []], "f.py", 2)
    assert empty.failed == 1 and "failed to import" in empty.failures["f.py"]


def test_causes_group_what_a_reader_can_act_on():
    assert suite.cause_of("[call] RuntimeError: Found no NVIDIA driver on your system") == (
        "Megatron-internal CUDA call (platform gap)")
    assert suite.cause_of("[call] RuntimeError: world_size (2) is not divisible by 4") == (
        "layout needs more ranks than the run has")
    assert suite.cause_of("[collect] E   RuntimeError: Found no NVIDIA driver") == (
        "the test file asks the GPU's generation at import (no GPU to ask)")
    assert suite.cause_of("[call] ValueError: odd 0x7f3a") == "[call] ValueError: odd 0x.."


def test_skip_patch_must_name_a_patch(fake_megatron_lm):
    out = subprocess.run([sys.executable, str(TOOL), "--megatron-lm-src", str(fake_megatron_lm),
                          "--skip-patch", "no such patch"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--skip-patch 'no such patch'" in out.stderr


@pytest.mark.skipif(not os.path.isdir("/work/.mirror/NVIDIA+Megatron-LM/repo"),
                    reason="no Megatron-LM git directory on this machine")
def test_megatron_multihot_converter_tests_pass_on_cpu():
    """Megatron's own test of the indices converter: its 200 cases all failed while the
    patch rebound only the dispatcher's name (the test imports the fusion module's)."""
    out = subprocess.run(
        [sys.executable, str(TOOL), "--megatron-lm-src", "/work/.mirror/NVIDIA+Megatron-LM/repo",
         "--files", "test_multihot_indices_converter.py", "--ranks", "1", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout)["files"]
    assert (row["passed"], row["failed"]) == (200, 0), row
