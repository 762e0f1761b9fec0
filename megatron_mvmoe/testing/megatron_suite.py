"""Run Megatron-LM's own unit tests (one file at a time, at N gloo ranks) through our CPU
platform layer and count passed/failed/skipped per file, with failures grouped by cause.

Design choices:
- The tests come from the user's Megatron-LM checkout or git directory and are copied into
  a fresh temporary directory (never into our repository): a git ref is read with
  `git archive`, a work tree is copied as it is.
- Each world size is one set of processes, one pytest session per rank over the selected
  files, started the way Megatron's CI starts them (WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT read by its test Utils); starting a session costs minutes on a small box.
  A per-test timeout and a process-group timeout keep a hang to one test; --isolate-files
  gives each file its own processes instead (a crash then costs one file).
- The only code between the tests and Megatron-Core is the platform layer and the
  test-side adapter (megatron_mvmoe/testing/megatron_test_adapter.py), loaded as a pytest
  plugin written into the temporary directory.
- A test passes at N ranks when it passes on every rank; it fails when any rank fails or
  errors in any phase, or when no rank reported it (the file was killed at its timeout).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_mvmoe.launch.local_ranks import free_port
from megatron_mvmoe.testing.megatron_layouts import rank_counts
from megatron_mvmoe.platform.cpu_patches import SKIP_ENV
from megatron_mvmoe.testing.megatron_test_adapter import PG_TIMEOUT_ENV, REPORT_ENV, TESTS_ROOT_ENV

MOE_TESTS = "tests/unit_tests/transformer/moe"
# What Megatron's MoE tests import besides their own directory.
_NEEDED_PATHS = ("tests/__init__.py", "tests/unit_tests",
                 "tests/test_utils/python_scripts/download_unit_tests_dataset.py")
DEFAULT_REF = "core_r0.19.0"
PLUGIN_NAME = "mvmoe_cpu_adapter"
_PLUGIN_SOURCE = '''"""Written by tools/megatron_moe_tests.py: our platform layer + the test-side adapter."""
from megatron_mvmoe.testing.megatron_test_adapter import (  # noqa: F401 - pytest hooks
    install, pytest_collection_finish, pytest_collectreport, pytest_runtest_logreport,
    pytest_unconfigure)

install()
'''


@dataclass
class FileResult:
    """Outcome counts of one test file at one world size."""

    file: str
    world_size: int
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    wall_s: float = 0.0
    """Seconds in this file's test phases (the slowest rank)."""
    killed: bool = False
    failures: Dict[str, str] = field(default_factory=dict)
    """nodeid -> first error line (on the first rank that failed)."""


# ---------------------------------------------------------------- getting the tests
def _git_dir(src: str) -> Optional[str]:
    if os.path.isdir(os.path.join(src, ".git")):
        return os.path.join(src, ".git")
    if os.path.isfile(os.path.join(src, "HEAD")) and os.path.isdir(os.path.join(src, "objects")):
        return src
    return None


def extract_tests(src: str, ref: Optional[str], dest: str) -> str:
    """Megatron-LM's tests/ (what the MoE tests need) under dest; returns dest.

    ref given: `git archive ref` of src (a checkout or a bare git dir); ref None: src's
    work tree as it is."""
    if not os.path.isdir(src):
        raise ValueError(f"--megatron-lm-src {src!r}: not a directory. Fix: pass a Megatron-LM "
                         "checkout or git directory")
    if ref is not None:
        git_dir = _git_dir(src)
        if git_dir is None:
            raise ValueError(f"--megatron-lm-src {src!r}: no git directory there to read --ref "
                             f"{ref} from. Fix: pass a git checkout, or --ref worktree")
        proc = subprocess.run(["git", "--git-dir", git_dir, "archive", ref, *_NEEDED_PATHS],
                              capture_output=True)
        if proc.returncode != 0:
            raise ValueError(f"--ref {ref!r}: git archive failed in {git_dir}: "
                             f"{proc.stderr.decode().strip().splitlines()[-1]}. Fix: pass a "
                             f"branch or tag of Megatron-LM (e.g. {DEFAULT_REF})")
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(dest, filter="data")
    else:
        for rel in _NEEDED_PATHS:
            path = os.path.join(src, rel)
            if not os.path.exists(path):
                raise ValueError(f"--megatron-lm-src {src!r}: {rel} is missing. Fix: point it at "
                                 "the root of a Megatron-LM checkout")
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(path):
                shutil.copytree(path, target)
            else:
                shutil.copy(path, target)
    if not os.path.isdir(os.path.join(dest, MOE_TESTS)):
        raise ValueError(f"{MOE_TESTS} not found in {src} at {ref or 'its work tree'}. Fix: "
                         f"use Megatron-LM's {DEFAULT_REF} branch or later")
    with open(os.path.join(dest, PLUGIN_NAME + ".py"), "w") as out:
        out.write(_PLUGIN_SOURCE)
    return dest


def test_files(tests_dir: str, only: Sequence[str] = ()) -> List[str]:
    """The MoE test files (relative to tests_dir), optionally only those named in `only`."""
    names = sorted(f for f in os.listdir(os.path.join(tests_dir, MOE_TESTS))
                   if f.startswith("test_") and f.endswith(".py"))
    if only:
        unknown = [f for f in only if f not in names and f + ".py" not in names]
        if unknown:
            raise ValueError(f"--files {unknown[0]!r}: no such file in {MOE_TESTS}. Fix: use one "
                             f"of {', '.join(names)}")
        names = [n for n in names if n in only or n[:-3] in only]
    return [f"{MOE_TESTS}/{n}" for n in names]


def rank_plan(tests_dir: str, files: Sequence[str],
              ranks: Optional[Sequence[int]] = None) -> Dict[str, List[int]]:
    """file -> the rank counts to run it at: `ranks` for every file, or (None) the counts
    its layouts need (megatron_layouts.rank_counts, read from the file, always 1)."""
    if ranks is not None:
        return {f: sorted(set(ranks)) for f in files}
    plan = {}
    for f in files:
        with open(os.path.join(tests_dir, f)) as source:
            plan[f] = rank_counts(source.read())
    return plan


# ---------------------------------------------------------------- running one file
def _rank_env(tests_dir: str, rank: int, world_size: int, port: int, report: str,
              pg_timeout_s: float) -> dict:
    env = dict(os.environ)
    env.update({
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p),
        TESTS_ROOT_ENV: tests_dir, REPORT_ENV: report, PG_TIMEOUT_ENV: str(pg_timeout_s),
        # each rank gets one core's worth of threads: ranks, not threads, share the CPU
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
    })
    return env


def _pytest_command(test_files: Sequence[str], keyword: Optional[str],
                    per_test_timeout_s: float) -> list:
    cmd = [sys.executable, "-m", "pytest", *test_files, "-p", PLUGIN_NAME,
           "-p", "no:cacheprovider", "-q", "--no-header", "-rN",
           f"--timeout={per_test_timeout_s:g}", "--timeout-method=signal", "-W", "ignore",
           "--continue-on-collection-errors"]
    if keyword:
        cmd += ["-k", keyword]
    return cmd


def run_files(tests_dir: str, test_files: Sequence[str], world_size: int, *,
              keyword: Optional[str] = None, per_test_timeout_s: float = 120.0,
              timeout_s: float = 1800.0, skip_patches: Sequence[str] = ()) -> List[FileResult]:
    """`test_files` in one pytest session per rank at `world_size` ranks, results split per
    file. One session because starting one (importing Megatron) costs minutes on a small,
    loaded box; run one file per call to isolate files from each other's crashes.
    `skip_patches` names platform patches to leave out (to measure what they fix)."""
    port = free_port()
    tag = (os.path.basename(test_files[0])[:-3] if len(test_files) == 1 else "session")
    tag = f"{tag}.ws{world_size}"
    reports = [os.path.join(tests_dir, f"report.{tag}.rank{r}.jsonl") for r in range(world_size)]
    for path in reports:
        if os.path.exists(path):
            os.remove(path)
    logs = [open(os.path.join(tests_dir, f"{tag}.rank{r}.log"), "w") for r in range(world_size)]
    envs = [_rank_env(tests_dir, r, world_size, port, reports[r], per_test_timeout_s)
            for r in range(world_size)]
    for env in envs:
        if skip_patches:
            env[SKIP_ENV] = ",".join(skip_patches)
    procs = [subprocess.Popen(_pytest_command(test_files, keyword, per_test_timeout_s),
                              cwd=tests_dir, stdout=logs[r], stderr=subprocess.STDOUT,
                              env=envs[r])
             for r in range(world_size)]
    killed = _wait_all(procs, timeout_s)
    for log in logs:
        log.close()
    rank_rows = [_read_report(p) for p in reports]
    results = []
    for test_file in test_files:
        per_rank = [_rows_of_file(rows, test_file) for rows in rank_rows]
        result = merge_rank_reports(per_rank, test_file, world_size)
        result.wall_s = round(max((sum(r.get("duration_s", 0.0) for r in rows)
                                   for rows in per_rank), default=0.0), 1)
        result.killed = killed
        results.append(result)
    return results


def _rows_of_file(rows: List[dict], test_file: str) -> List[dict]:
    out = []
    for row in rows:
        if "collected" in row:
            out.append({"collected": [n for n in row["collected"]
                                      if n.split("::")[0] == test_file]})
        elif row["nodeid"].split("::")[0] == test_file:
            out.append(row)
    return out


def _wait_all(procs, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    killed = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True
    if killed:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return killed


def _read_report(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as rows:
        return [json.loads(line) for line in rows if line.strip()]


def merge_rank_reports(rank_rows: List[List[dict]], test_file: str,
                       world_size: int) -> FileResult:
    """Per-test outcome over ranks: failed if any rank failed or errored (or none reported
    it), passed if every rank's call passed, else skipped."""
    collected: List[str] = []
    per_test: Dict[str, Dict[int, List[dict]]] = {}
    for rank, rows in enumerate(rank_rows):
        for row in rows:
            if "collected" in row:
                collected = collected or row["collected"]
                continue
            per_test.setdefault(row["nodeid"], {}).setdefault(rank, []).append(row)
    result = FileResult(test_file, world_size)
    for nodeid in collected or list(per_test):
        outcome, error = _merge_outcome(per_test.get(nodeid, {}), world_size)
        setattr(result, outcome, getattr(result, outcome) + 1)
        if outcome == "failed":
            result.failures[nodeid] = error
    if not collected and not per_test:
        result.failed = 1
        result.failures[test_file] = "no test collected: the file failed to import or run"
    return result


def _merge_outcome(by_rank: Dict[int, List[dict]], world_size: int):
    for rank in sorted(by_rank):
        for row in by_rank[rank]:
            if row["outcome"] == "failed":
                return "failed", f"[{row['when']}] {row['error']}"
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        return "failed", f"no result from rank {missing[0]} (file killed at its timeout)"
    calls = [row for rows in by_rank.values() for row in rows if row["when"] == "call"]
    if len(calls) == world_size and all(row["outcome"] == "passed" for row in calls):
        return "passed", ""
    return "skipped", ""


# ---------------------------------------------------------------- causes
# First error lines -> the cause a reader can act on (checked in order; unknown lines
# are their own cause).
CAUSES = (
    (r"^\[collect\].*(NVIDIA driver|CUDA)",
     "the test file asks the GPU's generation at import (no GPU to ask)"),
    (r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|CUDA driver|"
     r"No CUDA GPUs|cudaGetDeviceCount", "Megatron-internal CUDA call (platform gap)"),
    (r"transformer_engine|Transformer Engine|TE is not installed|requires TE|HAVE_TE",
     "needs Transformer Engine"),
    (r"[Aa]pex|persist_layer_norm not supported", "needs apex (fused layer norm)"),
    (r"deep_ep|DeepEP|hybrid_ep|HybridEP", "needs DeepEP/HybridEP"),
    (r"[Tt]riton|cuda.*kernel|no kernel image", "needs a GPU kernel (Triton/CUDA)"),
    (r"Timeout|timed out|Timed out|killed at its timeout", "timeout"),
    (r"world_size \(\d+\) is not divisible by|world size .* too small|requires \d+ ranks",
     "layout needs more ranks than the run has"),
    (r"device\.type == .cuda.|is_cuda|'cpu' == 'cuda'", "test asserts a CUDA device"),
)


def cause_of(error: str) -> str:
    for pattern, cause in CAUSES:
        if re.search(pattern, error):
            return cause
    return re.sub(r"0x[0-9a-f]+", "0x..", error)[:160]


def causes(results: Sequence[FileResult]) -> Counter:
    return Counter(cause_of(err) for r in results for err in r.failures.values())


def best_per_file(results: Sequence[FileResult]) -> Dict[str, FileResult]:
    """file -> its result at the rank count where most of its tests pass (ties: fewer
    failures, then fewer ranks)."""
    best: Dict[str, FileResult] = {}
    for r in sorted(results, key=lambda r: (-r.passed, r.failed, r.world_size)):
        best.setdefault(r.file, r)
    return best


def totals(results: Sequence[FileResult]) -> Dict[str, int]:
    return {k: sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped")}
