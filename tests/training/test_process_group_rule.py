"""The training loop takes its process groups from the run's `pg_collection` (Megatron's
ProcessGroupCollection, built once by megatron_mvmoe.parallel.initialize_layout), never from
Megatron's `parallel_state` globals: read from every training module's source (its imports, at
any depth, function-level ones included), so a new global read cannot slip back in.

Megatron's parallel state is initialised in megatron_mvmoe/parallel.py, outside training/;
`training/` reaches it only through that module. EXEMPT lists the training modules that still
read it, as debt (each must still do so: fixing one fails the test until it is removed here;
a module moved out of training/ drops out of the check).
"""

import ast
import pathlib
from typing import Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAINING = ROOT / "megatron_mvmoe" / "training"
GLOBAL_STATE = ("parallel_state", "mpu")
"""Megatron's module of process-group globals, and Megatron-LM's old name for it."""

EXEMPT: set = set()
"""Empty since generation moved out of training/ into megatron_mvmoe/toolkit/."""


def parallel_state_uses(source: str) -> Set[str]:
    """Every way `source` reaches Megatron's parallel_state: 'import <module>',
    'from <module> import ...', 'from megatron.core import parallel_state'."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(f"import {a.name}" for a in node.names
                         if a.name.split(".")[-1] in GLOBAL_STATE)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[-1] in GLOBAL_STATE:
                found.add(f"from {module} import ...")
            found.update(f"from {module} import {a.name}" for a in node.names
                         if module.startswith("megatron") and a.name in GLOBAL_STATE)
    return found


def offenders() -> dict:
    return {path.name: uses for path in sorted(TRAINING.rglob("*.py"))
            if (uses := parallel_state_uses(path.read_text()))}


def test_training_reads_process_groups_from_pg_collection_only():
    found = offenders()
    new = {name: uses for name, uses in found.items() if name not in EXEMPT}
    assert not new, (f"training modules reading Megatron's parallel_state: {new}. Fix: take "
                     "the group from trainer.pg_collection (or the pg_collection passed in)")
    present = {name for name in EXEMPT if (TRAINING / name).exists()}
    assert present - set(found) == set(), (
        f"no longer read parallel_state, remove from EXEMPT: {present - set(found)}")


def test_every_way_of_reaching_parallel_state_is_caught():
    assert parallel_state_uses("from megatron.core import parallel_state\n")
    assert parallel_state_uses("def f():\n    import megatron.core.parallel_state as ps\n")
    assert parallel_state_uses("from megatron.core.parallel_state import get_data_parallel_group\n")
    assert parallel_state_uses("from megatron.core import mpu\n")
    assert not parallel_state_uses("from megatron.core.process_groups_config import "
                                   "ProcessGroupCollection\n")
    assert not parallel_state_uses("from megatron_mvmoe.parallel import initialize_layout\n")
