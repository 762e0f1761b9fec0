"""Run Megatron-LM's own MoE unit tests (tests/unit_tests/transformer/moe) on CPU with gloo,
through our platform layer, and print passed/failed/skipped per file and failures by cause.

    python tools/megatron_moe_tests.py --megatron-lm-src ~/src/Megatron-LM \\
        [--ref core_r0.19.0 | --ref worktree] [--ranks auto | --ranks 1 2] [--files test_routers.py ...] \\
        [-k EXPR] [--per-test-timeout 120] [--timeout 3600] [--isolate-files] [--keep DIR] \\
        [--skip-patch NAME ...] [--json]

--megatron-lm-src is your Megatron-LM checkout (or a bare git directory). The tests are
read at --ref with `git archive` (default core_r0.19.0, the release branch of the installed
megatron-core 0.19.2; `--ref worktree` copies the checkout's files as they are) into a
temporary directory, never into this repository.

Between the tests and Megatron-Core sit only our platform layer
(megatron_mvmoe/platform/cpu_patches.py) and a test-side adapter written into that
temporary directory as a pytest plugin (megatron_mvmoe/testing/megatron_test_adapter.py):
the tests' own `.cuda()`, `device="cuda"` and `torch.cuda.is_available()` mean the CPU, and
their NCCL init runs on gloo. Megatron-Core's own CUDA calls are not adapted, so a failure
caused by one is a platform gap.

--compare BEFORE.json AFTER.json runs nothing: it prints the per-file counts of two
earlier `--json` runs side by side (markdown; with --json one object holding both).

--skip-patch leaves a named platform patch out (names: megatron_mvmoe.platform.cpu_patches
.ALL_PATCHES), to count what it fixes.

--ranks auto (the default) runs each file at the rank counts its layouts need, read from
the file (its parametrized tp/ep/pp/cp sizes and initialize_model_parallel calls: the
smallest of 1, 2, 4, 8 that each layout fits, always 1; megatron_mvmoe/testing/
megatron_layouts.py; checked against core_r0.19.0's files by
tests/platform/test_megatron_layouts.py); --ranks 1 2 runs every file at those counts.

Each rank count is one pytest session per rank over the files run at it (launched like
Megatron's CI: WORLD_SIZE / LOCAL_RANK / MASTER_PORT; --isolate-files: one per file). A test
passes at N ranks when it passes on every rank. Per file the report gives each count and
the best one (most tests passed). Filter with --files / -k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from typing import List, Optional

from megatron_mvmoe.testing import megatron_suite as suite
from megatron_mvmoe.toolkit.flags import tool_parser


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = tool_parser(__doc__)  # the whole docstring; a wrong flag is one line, exit 2
    parser.add_argument("--megatron-lm-src", help="Megatron-LM checkout or git directory")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="two earlier --json outputs: print them side by side")
    parser.add_argument("--ref", default=suite.DEFAULT_REF,
                        help=f"git ref to read the tests at (default {suite.DEFAULT_REF}); "
                             "'worktree' = the checkout's files")
    parser.add_argument("--ranks", nargs="+", default=["auto"],
                        help="'auto' (each file at the counts its layouts need) or counts")
    parser.add_argument("--files", nargs="+", default=[],
                        help="only these test files (e.g. test_routers.py)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--per-test-timeout", type=float, default=120.0, metavar="S")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                        help="kill a session's ranks after this long")
    parser.add_argument("--isolate-files", action="store_true",
                        help="one session per file (slower; a crash costs one file)")
    parser.add_argument("--keep", metavar="DIR",
                        help="extract into DIR and keep it (logs per file and rank)")
    parser.add_argument("--skip-patch", nargs="+", default=[], metavar="NAME",
                        help="leave these platform patches out")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not args.compare and not args.megatron_lm_src:
        parser.error("--megatron-lm-src is required. Fix: pass your Megatron-LM checkout "
                     "(or --compare BEFORE.json AFTER.json)")
    from megatron_mvmoe.platform.cpu_patches import ALL_PATCHES

    names = [p.name for p in ALL_PATCHES]
    unknown = [n for n in args.skip_patch if n not in names]
    if unknown:
        parser.error(f"--skip-patch {unknown[0]!r}: no such patch. Fix: use one of {names}")
    args.ranks = _rank_counts(parser, args.ranks)
    for name in ("per_test_timeout", "timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
    return args


def _rank_counts(parser: argparse.ArgumentParser, values: List[str]) -> Optional[List[int]]:
    """None for 'auto', else the counts (each >= 1)."""
    if values == ["auto"]:
        return None
    if "auto" in values:
        parser.error(f"--ranks {' '.join(values)}: 'auto' stands alone (or give counts, "
                     "e.g. --ranks 1 2)")
    for value in values:
        if not value.isdigit() or int(value) < 1:
            parser.error(f"--ranks {value}: a rank count must be >= 1 (or --ranks auto)")
    return sorted({int(v) for v in values})


def _cell(r: Optional[suite.FileResult]) -> str:
    if r is None:
        return "-"
    return f"{r.passed}/{r.failed}/{r.skipped}" + (" (killed)" if r.killed else "")


def print_table(results: List[suite.FileResult]) -> None:
    ranks = sorted({r.world_size for r in results})
    header = " | ".join(f"{n} rank{'s' * (n > 1)}" for n in ranks)
    print(f"| file (pass/fail/skip) | {header} | best |")
    print("|---|" + "---|" * (len(ranks) + 1))
    by_key = {(r.file, r.world_size): r for r in results}
    best = suite.best_per_file(results)
    for file, top in best.items():
        cells = [_cell(by_key.get((file, n))) for n in ranks]
        cells.append(f"{_cell(top)} at {top.world_size}")
        print(f"| {os.path.basename(file)} | {' | '.join(cells)} |")
    t = suite.totals(list(best.values()))
    print(f"total, best per file: {t['passed']} passed, {t['failed']} failed, "
          f"{t['skipped']} skipped")
    for n in ranks:
        t = suite.totals([r for r in results if r.world_size == n])
        print(f"total at {n} rank(s): {t['passed']} passed, {t['failed']} failed, "
              f"{t['skipped']} skipped")
        for cause, count in suite.causes([r for r in results if r.world_size == n]).most_common():
            print(f"  {count:4d}  {cause}")


def _load_run(path: str) -> dict:
    try:
        with open(path) as f:
            run = json.load(f)
        return {(os.path.basename(r["file"]), r["world_size"]): r for r in run["files"]}
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--compare {path!r}: not a `--json` output of this tool ({err}). "
                         "Fix: pass files written by `megatron_moe_tests.py --json`")


def compare(before_path: str, after_path: str, as_json: bool) -> None:
    """Per-file counts of two runs side by side."""
    before, after = _load_run(before_path), _load_run(after_path)
    ranks = sorted({n for _, n in after})
    files = sorted({f for f, _ in after})
    if as_json:
        print(json.dumps(dict(before={f"{f}@{n}": v for (f, n), v in before.items()},
                              after={f"{f}@{n}": v for (f, n), v in after.items()}), indent=1))
        return
    cells = " | ".join(f"{n} rank{'s' * (n > 1)} before | {n} rank{'s' * (n > 1)} after"
                       for n in ranks)
    print(f"| file (pass/fail/skip) | {cells} |")
    print("|---|" + "---|" * (2 * len(ranks)))

    def cell(run, key):
        r = run.get(key)
        return "-" if r is None else f"{r['passed']}/{r['failed']}/{r['skipped']}"

    for f in files + ["total"]:
        row = []
        for n in ranks:
            for run in (before, after):
                if f == "total":
                    rows = [v for (_, m), v in run.items() if m == n]
                    row.append("/".join(str(sum(v[k] for v in rows))
                                        for k in ("passed", "failed", "skipped")))
                else:
                    row.append(cell(run, (f, n)))
        print(f"| {f} | {' | '.join(row)} |")
    for label, run in (("before", before), ("after", after)):
        for n in ranks:
            errors = [e for (_, m), v in run.items() if m == n for e in v["failures"].values()]
            print(f"\nfailures {label} at {n} rank(s), by cause:")
            for cause, count in Counter(suite.cause_of(e) for e in errors).most_common():
                print(f"  {count:4d}  {cause}")


def run(args: argparse.Namespace, tests_dir: str) -> List[suite.FileResult]:
    ref = None if args.ref == "worktree" else args.ref
    suite.extract_tests(args.megatron_lm_src, ref, tests_dir)
    files = suite.test_files(tests_dir, args.files)
    plan = suite.rank_plan(tests_dir, files, args.ranks)
    results = []
    for n in sorted({n for counts in plan.values() for n in counts}):
        files_n = [f for f in files if n in plan[f]]
        sessions = [[f] for f in files_n] if args.isolate_files else [files_n]
        for session in sessions:
            for result in suite.run_files(tests_dir, session, n, keyword=args.keyword,
                                          per_test_timeout_s=args.per_test_timeout,
                                          timeout_s=args.timeout,
                                          skip_patches=args.skip_patch):
                results.append(result)
                if not args.json:
                    print(f"{os.path.basename(result.file)} at {n} rank(s): {result.passed} "
                          f"passed, {result.failed} failed, {result.skipped} skipped",
                          flush=True)
    return results


def report(args: argparse.Namespace, results: List[suite.FileResult]) -> dict:
    """The --json object: every (file, rank count) result, totals and causes per count, and
    per file the rank counts run and the best of them."""
    ranks = sorted({r.world_size for r in results})
    by_ranks = {str(n): dict(totals=suite.totals([r for r in results if r.world_size == n]),
                             causes=dict(suite.causes(
                                 [r for r in results if r.world_size == n]).most_common()))
                for n in ranks}
    best = suite.best_per_file(results)
    rank_counts = {os.path.basename(f): sorted(r.world_size for r in results if r.file == f)
                   for f in best}
    return dict(ref=args.ref, ranks="auto" if args.ranks is None else args.ranks,
                keyword=args.keyword, skipped_patches=args.skip_patch,
                files=[asdict(r) for r in results], by_ranks=by_ranks,
                rank_counts=rank_counts,
                best={os.path.basename(f): dict(world_size=r.world_size, passed=r.passed,
                                                failed=r.failed, skipped=r.skipped)
                      for f, r in best.items()},
                best_totals=suite.totals(list(best.values())))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.compare:
            compare(*args.compare, args.json)
            return 0
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            results = run(args, os.path.abspath(args.keep))
        else:
            with tempfile.TemporaryDirectory(prefix="megatron_moe_tests_") as tests_dir:
                results = run(args, tests_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report(args, results), indent=1))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
