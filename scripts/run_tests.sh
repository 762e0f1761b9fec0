#!/usr/bin/env bash
# The test suite, fail-fast, in two phases; stops at the first failure. Extra args go to
# pytest (e.g. -m "not slow"). The 25 slowest tests of each phase are listed at its end:
# the place to trim when the suite nears the 30-minute CI budget.
# 1. Everything but SERIAL on two pytest-xdist workers, one test file per worker at a time
#    (--dist loadfile: a file's module fixtures are built once). Most of a test's wall time
#    is one process (imports, a tiny model, a forked rank waiting on the other), so two
#    workers keep both CI cores busy. Every port is picked free (launch.local_ranks.free_port)
#    and every path is a tmp_path, so two files can run side by side. A failure stops both
#    workers once the other has finished the file it holds (pytest-xdist: exit status 2).
# 2. SERIAL, alone: real launchers (torchrun / mpirun / a Slurm cluster the tests start, with
#    fixed daemon state and a veth pair) and tests that time a rank's exit or a signal's
#    effect against a deadline.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
# pytest-xdist 3.8 hands files out most-tests-first (--loadscope-reorder, its default), so
# ORDER only breaks ties: the long files (few, long tests) start mid-queue and the last ones
# are one- and two-test files, none among CI's 25 slowest tests (under 18 s): a short tail.
ORDER=(test_dependency_rules.py test_import_graph.py test_docs_resolve.py functional config routing views mhmoe kernels platform data layers launch planning training toolkit analysis)
SERIAL=(tests/launch/test_launchers.py tests/launch/test_torchrun_patch.py
        tests/launch/test_torchrun_signals.py tests/launch/test_error_once.py
        tests/launch/test_a2a_wire.py tests/launch/test_two_node_slurm.py
        tests/launch/test_two_node_stops.py
        tests/training/test_dead_rank.py tests/training/test_save_lock.py)
dirs=()
for d in "${ORDER[@]}"; do [ -e "tests/$d" ] && dirs+=("tests/$d"); done
for d in tests/*/; do
  d=${d%/}; case " ${dirs[*]} " in *" $d "*) ;; *) dirs+=("$d");; esac
done
ignore=()
for s in "${SERIAL[@]}"; do ignore+=("--ignore=$s"); done
# pytest's exit status 5 (nothing collected: a -m filter that leaves a phase empty) is no failure.
run_pytest() {
  local rc=0
  .venv/bin/python -m pytest -x -q --timeout=900 --durations=25 -p no:cacheprovider "$@" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
}
start=$(date +%s)
run_pytest -n 2 --dist loadfile "${ignore[@]}" "${dirs[@]}" "$@"
echo "[tests] parallel phase wall time $(( $(date +%s) - start )) s"
run_pytest "${SERIAL[@]}" "$@"
echo "[tests] total wall time $(( $(date +%s) - start )) s"
