"""Kill a process at the k-th file-system operation of a block, not by timing: the
publish-window tests (test_publish_window.py) run checkpoint publishing inside
`dying_at(k, die)` for k = 1, 2, ... until one runs to the end.

Operations counted: os.rename, os.replace (so also the `latest` pointer's temp-file swap),
and shutil.rmtree of an existing directory twice: before it deletes anything, and with
one file deleted (a directory half gone, as a kill in the middle of rmtree leaves it)."""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator, List, Optional


def _first_file(directory: str) -> Optional[str]:
    for base, _, names in sorted(os.walk(directory)):
        if names:
            return os.path.join(base, sorted(names)[0])
    return None


@contextlib.contextmanager
def dying_at(kill_at: int, die: Callable[[], None]) -> Iterator[List[int]]:
    """Call `die()` just before the `kill_at`-th operation; yields [operations counted so
    far] (fewer than `kill_at` after the block: it ran to the end)."""
    count = [0]
    real_rename, real_replace, real_rmtree = os.rename, os.replace, shutil.rmtree

    def tick():
        count[0] += 1
        if count[0] == kill_at:
            die()

    def rename(*args, **kwargs):
        tick()
        return real_rename(*args, **kwargs)

    def replace(*args, **kwargs):
        tick()
        return real_replace(*args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if os.path.isdir(path):
            tick()
            first = _first_file(path)
            if first is not None:
                os.unlink(first)
                tick()
        return real_rmtree(path, *args, **kwargs)

    os.rename, os.replace, shutil.rmtree = rename, replace, rmtree
    try:
        yield count
    finally:
        os.rename, os.replace, shutil.rmtree = real_rename, real_replace, real_rmtree
