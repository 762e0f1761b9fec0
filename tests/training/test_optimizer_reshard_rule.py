"""Which saved optimizer states a resume loads (checkpoint._loadable_optimizer_format),
against the rule written out by hand: an EP switch between 1 and > 1 restarts Adam in BOTH
formats (Megatron's chained expert optimizer prefixes its sharded keys with `chained_<i>.`,
a single optimizer does not), and the warning says so instead of advising
fully_reshardable; dp_reshardable loads only at the saved layout; fully_reshardable loads
at any layout that keeps EP on the same side of 1."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_mvmoe.training.checkpoint import _loadable_optimizer_format
from megatron_mvmoe.training.checkpoint_parts import RunMetadata

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layout(ep, pp=1):
    return {"tp": 1, "pp": pp, "ep": ep, "etp": None, "vpp": None}


def _trainer(ep, pp=1):
    return SimpleNamespace(run=SimpleNamespace(parallel=SimpleNamespace(
        tp=1, pp=pp, ep=ep, etp=None, vpp=None)))


def _expected(saved_format, saved_ep, saved_pp, ep, pp):
    """The rule, naively."""
    if (saved_ep > 1) != (ep > 1):
        return None
    if saved_format == "dp_reshardable":
        return saved_format if (saved_ep, saved_pp) == (ep, pp) else None
    return saved_format


CASES = [(fmt, s_ep, s_pp, ep, pp) for fmt in ("dp_reshardable", "fully_reshardable")
         for s_ep, s_pp, ep, pp in [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1), (2, 1, 4, 1),
                                    (2, 1, 2, 2), (1, 2, 1, 1), (1, 1, 1, 2)]]


@pytest.mark.parametrize("fmt,saved_ep,saved_pp,ep,pp", CASES)
def test_loadable_format_follows_the_rule(capsys, fmt, saved_ep, saved_pp, ep, pp):
    saved = RunMetadata(optimizer_format=fmt, layout=_layout(saved_ep, saved_pp))
    got = _loadable_optimizer_format(_trainer(ep, pp), saved, load_optimizer=True)
    assert got == _expected(fmt, saved_ep, saved_pp, ep, pp)
    printed = capsys.readouterr().out
    if (saved_ep > 1) != (ep > 1):
        assert f"saved with ep={saved_ep} cannot load at ep={ep}" in printed
        assert "Save with ckpt_optimizer_format=fully_reshardable" not in printed
    elif got is None:
        assert "dp_reshardable" in printed
    else:
        assert printed == ""


def test_no_optimizer_requested_or_saved_loads_none():
    saved = RunMetadata(optimizer_format="fully_reshardable", layout=_layout(1))
    assert _loadable_optimizer_format(_trainer(1), saved, load_optimizer=False) is None
    assert _loadable_optimizer_format(_trainer(1), RunMetadata(optimizer_format=None),
                                      load_optimizer=True) is None
