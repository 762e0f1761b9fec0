"""The trainer, the model, its layers and routers, and the tools' toolkit take their process
groups from the `pg_collection` their caller holds (Megatron's ProcessGroupCollection, built
once by megatron_mvmoe.parallel.initialize_layout), never from Megatron's `parallel_state`
globals: read from every module's source under GUARDED (its imports, at any depth,
function-level ones included), so a new global read cannot slip back in.

Megatron's parallel state is initialised in megatron_mvmoe/parallel.py, outside GUARDED; the
guarded packages reach it only through that module. EXEMPT lists the modules that still read
it, as debt (each must still do so: fixing one fails the test until it is removed here).
"""

import ast
import pathlib
from typing import Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUARDED = ("training", "models", "routing", "layers", "toolkit")
"""The packages of megatron_mvmoe under the rule (issue 40 extended it past training/)."""
GLOBAL_STATE = ("parallel_state", "mpu")
"""Megatron's module of process-group globals, and Megatron-LM's old name for it."""

EXEMPT: set = set()
"""Paths under megatron_mvmoe/ (e.g. "layers/cp_attention.py"); empty."""


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
    package = ROOT / "megatron_mvmoe"
    return {str(path.relative_to(package)): uses for name in GUARDED
            for path in sorted((package / name).rglob("*.py"))
            if (uses := parallel_state_uses(path.read_text()))}


def test_groups_come_from_pg_collection_only():
    found = offenders()
    new = {name: uses for name, uses in found.items() if name not in EXEMPT}
    assert not new, (f"modules reading Megatron's parallel_state: {new}. Fix: take the group "
                     "from the pg_collection the caller holds (trainer.pg_collection, or the "
                     "one passed in)")
    present = {name for name in EXEMPT if (ROOT / "megatron_mvmoe" / name).exists()}
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


class _Group:
    """A pipeline group as Megatron's helpers ask it: this rank and the group's size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_stage_flags_from_the_pipeline_group_match_megatrons_global_reading(monkeypatch):
    """models/provider.py asks pg_collection.pp where it read parallel_state's
    is_pipeline_first/last_stage(ignore_virtual=False): the same answers (their formula)."""
    import torch

    from megatron_mvmoe.models.provider import _stage_flags

    # Megatron's get_pg_rank/size read a group only once torch.distributed is initialised
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)

    for pp in (1, 3):
        for vp_size in (None, 2):
            for rank in range(pp):
                for vp in ([None] if vp_size is None else range(vp_size)):
                    first_vp = vp_size is None or vp == 0
                    last_vp = vp_size is None or vp == vp_size - 1
                    assert _stage_flags(vp, _Group(rank, pp), vp_size) == dict(
                        pre_process=first_vp and rank == 0,
                        post_process=last_vp and rank == pp - 1), (pp, vp_size, rank, vp)
