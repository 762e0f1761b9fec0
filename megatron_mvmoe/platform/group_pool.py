"""Megatron's model-parallel subgroups pooled across destroy/initialize cycles of one world
(a CPU patch, registered in cpu_patches.PATCHES): gloo subgroups that outlive
`destroy_model_parallel` keep their threads, so a process that re-initialises parallel state
(tests, tools that open several layouts) would leak threads until it stalls."""

from __future__ import annotations

import functools
import importlib

import torch

from megatron_mvmoe.platform.patch import Patch

_GLOO_GLOBALS_SUFFIX = "_GLOO"


class _GroupPool:
    """Megatron's subgroups, kept across destroy/initialize cycles of one world.

    A gloo group's threads and sockets are freed only when its C++ object dies, i.e. once
    nothing references the Python group; a model, optimizer or test that outlives
    `destroy_model_parallel` keeps them alive, and destroying the group does not help
    (`ProcessGroupGloo.shutdown/abort` leave its threads running). So the same group is
    handed out again when Megatron asks for the same ranks with the same settings: the
    threads are bounded by the distinct groups of a world, whoever holds references.

    Every rank makes the same create_group calls in the same order (torch's new_group is
    collective), so every rank hits or misses the pool together. The pool belongs to one
    default group: a new world (init_process_group after destroy_process_group) starts an
    empty pool."""

    def __init__(self) -> None:
        self._world = None  # weak reference to the default group the pool belongs to
        self._groups: dict = {}

    def _current(self) -> dict:
        import weakref

        default = torch.distributed.distributed_c10d._get_default_group()
        if self._world is None or self._world() is not default:
            self._world, self._groups = weakref.ref(default), {}
        return self._groups

    def get(self, create, ranks, timeout=None, backend=None, pg_options=None,
            use_local_synchronization=False, group_desc=None):
        """(group, created now) for Megatron's create_group arguments."""
        kwargs = dict(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                      use_local_synchronization=use_local_synchronization,
                      group_desc=group_desc)
        if pg_options is not None:  # options objects do not compare: never pooled
            return create(**kwargs), True
        key = (tuple(ranks) if ranks is not None else None, str(timeout), str(backend),
               use_local_synchronization, group_desc)
        groups = self._current()
        if key in groups:
            return groups[key], False
        groups[key] = create(**kwargs)
        return groups[key], True


def _pool_model_parallel_groups() -> None:
    """`initialize_model_parallel` builds every subgroup anew (gloo on CPU: threads and
    sockets each) and `destroy_model_parallel` only forgets them (it destroys the *_GLOO
    ones), so a process that re-initialises parallel state (a test session, a sweep, an
    evaluation server) gains ~30 threads per cycle until it stalls; destroying them too
    frees nothing while a model still references them. Megatron's `create_group` takes
    its groups from a `_GroupPool`, and `destroy_model_parallel` leaves pooled groups alive
    for the next initialisation."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    original_create = parallel_state.create_group
    original_destroy = parallel_state.destroy_model_parallel
    pool = _GroupPool()

    @functools.wraps(original_create)
    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        group, created = pool.get(original_create, ranks, timeout, backend, pg_options,
                                  use_local_synchronization, group_desc)
        if not created:  # Megatron's own bookkeeping (update_pg_timeout walks this list)
            if parallel_state._global_process_group_list is None:
                parallel_state._global_process_group_list = [None]
            if torch.distributed.get_rank() in ranks:
                parallel_state._global_process_group_list.append(group)
        return group

    @functools.wraps(original_destroy)
    def destroy_model_parallel():
        for name in dir(parallel_state):  # pooled: forget, do not destroy
            if name.endswith(_GLOO_GLOBALS_SUFFIX) and name.isupper():
                setattr(parallel_state, name, None)
        original_destroy()

    create_group._mvmoe_wrapped = True
    destroy_model_parallel._mvmoe_wrapped = True
    parallel_state.create_group = create_group
    parallel_state.destroy_model_parallel = destroy_model_parallel


def _groups_recreated_on_reinit() -> bool:
    """On a one-rank gloo world of its own (only when none is initialised): does a second
    initialize_model_parallel, after destroy, while the first one's groups are still
    referenced, build new groups (new threads) instead of reusing them?"""
    import tempfile

    parallel_state = importlib.import_module("megatron.core.parallel_state")
    if torch.distributed.is_initialized():
        # cannot probe without disturbing the caller's groups
        return not getattr(parallel_state.create_group, "_mvmoe_wrapped", False)
    store = tempfile.NamedTemporaryFile(prefix="mvmoe_pg_probe_", delete=False).name
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        held = parallel_state.get_tensor_model_parallel_group()
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()
        again = parallel_state.get_tensor_model_parallel_group()
        parallel_state.destroy_model_parallel()
        return again is not held
    finally:
        torch.distributed.destroy_process_group()


POOLED_GROUPS = Patch(
    "model-parallel groups pooled",
    "initialize_model_parallel builds new (gloo on CPU) subgroups on every call and "
    "destroy_model_parallel only forgets them; their threads die only with the last "
    "reference: a process that re-initialises parallel state leaks threads until it "
    "stalls.",
    _pool_model_parallel_groups, _groups_recreated_on_reinit)
