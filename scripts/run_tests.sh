#!/usr/bin/env bash
# The test suite, fail-fast: pure-math unit tests first, then Megatron layers, distributed,
# launcher and functional training tests; stops at the first failure. Extra args go to
# pytest (e.g. -m "not slow"). The 25 slowest tests are listed at the end: the place to trim
# when the suite nears the 30-minute CI budget.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
ORDER=(test_dependency_rules.py test_import_graph.py test_docs_resolve.py functional config routing views mhmoe kernels platform data layers launch planning training toolkit analysis)
dirs=()
for d in "${ORDER[@]}"; do [ -e "tests/$d" ] && dirs+=("tests/$d"); done
for d in tests/*/; do
  d=${d%/}; case " ${dirs[*]} " in *" $d "*) ;; *) dirs+=("$d");; esac
done
start=$(date +%s)
.venv/bin/python -m pytest -x -q --timeout=900 --durations=25 -p no:cacheprovider "${dirs[@]}" "$@"
echo "[tests] total wall time $(( $(date +%s) - start )) s"
