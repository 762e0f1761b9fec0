"""checkpointing.integrity.first_failure on 2 gloo ranks: the first failing rank's
`Type: first message line` reaches every rank, also for an exception whose message is empty
(it raised IndexError on `str(err).splitlines()[0]` before)."""

from __future__ import annotations

import tempfile

import pytest

from megatron_mvmoe.testing.spawn import run_distributed

pytestmark = pytest.mark.timeout(240)

ERRORS = {"empty": OSError(), "empty_key": KeyError(""), "two_lines": ValueError("first\nsecond")}


def _naive_line(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text.split(chr(10))[0]}" if text else type(err).__name__


def _failures(rank, world_size, names):
    from megatron_mvmoe.checkpointing.integrity import first_failure

    root = tempfile.gettempdir()
    out = {}
    for name in names:  # rank 0 saved fine, rank 1 failed with ERRORS[name]
        out[name] = first_failure(ERRORS[name] if rank == 1 else None, root)
    out["none"] = first_failure(None, root)
    return out


def test_every_rank_gets_the_failing_ranks_one_line_even_for_an_empty_message():
    names = sorted(ERRORS)
    per_rank = run_distributed(_failures, 2, args=(names,))
    for got in per_rank:
        assert got["none"] is None
        for name in names:
            disk_full, line = got[name]
            assert line == _naive_line(ERRORS[name]) and not disk_full
    assert per_rank[0]["empty"][1] == "OSError"
    assert per_rank[0]["empty_key"][1] == "KeyError: ''"
    assert per_rank[1]["two_lines"][1] == "ValueError: first"
