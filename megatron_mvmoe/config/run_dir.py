"""What a run writes into its `logging.run_dir` that a reader elsewhere opens: the names
shared by the writer (training/) and the reader (analysis/, tools/), kept here at the bottom
so that neither imports the other."""

from __future__ import annotations

import os

MEMORY_DIR = "memory"
"""The per-rank memory census: training/memory_report.py writes `memory/rank<R>.json`,
planning/validate.py (`tools/plan.py --validate RUN_DIR`) reads it."""


def memory_record_path(run_dir: str, rank: int) -> str:
    """Where rank `rank` of the run writes its memory census."""
    return os.path.join(run_dir, MEMORY_DIR, f"rank{rank}.json")
