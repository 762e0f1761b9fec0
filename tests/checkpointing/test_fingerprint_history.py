"""Every on-disk format the project has written still passes the fingerprint check
against today's model built from its own config (tests/assets/run_state/: a real
run_state.json per format, README there), a structural difference is still refused
naming the field, and fields that hold no parameters may change on resume."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest

from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.fingerprint import (ADDED_LATER, NOT_STRUCTURAL,
                                                      SHAPE_FIELDS, STRUCTURAL,
                                                      changed_on_resume, check_fingerprint,
                                                      model_fingerprint, run_fingerprint)
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.run_config import saved_config_from_dict

ASSETS = os.path.join(os.path.dirname(__file__), "..", "assets", "run_state")
STORED = sorted(glob.glob(os.path.join(ASSETS, "*.json")))


def _stored(path: str):
    with open(path) as fh:
        meta = json.load(fh)
    return meta, saved_config_from_dict(meta["config"])


def test_one_stored_run_state_per_format():
    names = {os.path.basename(p) for p in STORED}
    assert names == {"0.16.1_2e076fd.json", "0.19.2_flat_1ce5799p.json",
                     "nested_05af3f0.json", "dispatcher_ecf52e9.json"}


@pytest.mark.parametrize("path", STORED, ids=os.path.basename)
def test_each_stored_format_matches_todays_model_from_its_config(path):
    meta, run = _stored(path)
    check_fingerprint(meta["fingerprint"], run_fingerprint(run), path)


@pytest.mark.parametrize("path", STORED, ids=os.path.basename)
def test_a_structural_difference_is_still_refused_naming_the_field(path):
    meta, run = _stored(path)
    wider = dataclasses.replace(run.model, hidden_size=2 * run.model.hidden_size)
    with pytest.raises(CheckpointError, match=r"differing fields: hidden_size: checkpoint 64 "
                                              r"vs this run 128\. Fix: "):
        check_fingerprint(meta["fingerprint"], model_fingerprint(wider), path)


def test_added_later_fields_take_their_old_value_and_only_those():
    """ADDED_LATER is the one table: each entry is missing from some stored format (else it
    is not needed) and its value is the one that format was built with."""
    metas = [_stored(p) for p in STORED]
    for name, old in ADDED_LATER.items():
        predating = [run for meta, run in metas if name not in meta["fingerprint"]]
        assert predating, f"{name}: no stored format predates it"
        assert all(getattr(run.model, name) == old for run in predating)
    oldest, run = _stored(os.path.join(ASSETS, "0.16.1_2e076fd.json"))
    with pytest.raises(CheckpointError, match=r"rotary_base: checkpoint 10000 vs this run 500000"):
        check_fingerprint(oldest["fingerprint"], model_fingerprint(
            dataclasses.replace(run.model, rotary_base=500000)), "ckpt")


def test_every_model_field_is_classified_structural_or_not():
    """The allow-list forces a decision for each new ModelSection field."""
    fields = {f.name for f in dataclasses.fields(ModelSection)}
    structural = fields & set(STRUCTURAL)
    assert structural | set(NOT_STRUCTURAL) == fields
    assert not structural & set(NOT_STRUCTURAL)
    assert set(SHAPE_FIELDS) <= fields


def test_dispatcher_and_gamma_ramp_may_change_and_are_named():
    meta, run = _stored(os.path.join(ASSETS, "dispatcher_ecf52e9.json"))
    model = dataclasses.replace(
        run.model, moe_dispatcher="dedup_rank", moe_dispatch_ranks_per_node=2,
        multi_view=dataclasses.replace(run.model.multi_view, gamma_ramp_steps=7))
    check_fingerprint(meta["fingerprint"], model_fingerprint(model), "ckpt")
    assert changed_on_resume(run.model, model) == [
        "moe_dispatch_ranks_per_node: checkpoint None -> this run 2",
        "moe_dispatcher: checkpoint 'alltoall' -> this run 'dedup_rank'",
        "multi_view.gamma_ramp_steps: checkpoint 100 -> this run 7"]
    assert changed_on_resume(run.model, run.model) == []


def test_training_only_megatron_fields_may_change_and_shape_fields_may_not():
    """`extra` was compared whole: a resume with another --moe-aux-loss-coeff or dropout was
    refused as "an incompatible model"; QK norm or the MLA ranks still are."""
    meta, run = _stored(os.path.join(ASSETS, "dispatcher_ecf52e9.json"))
    retrained = dataclasses.replace(run.model, extra={
        **run.model.extra, "moe_aux_loss_coeff": 0.05, "hidden_dropout": 0.1})
    check_fingerprint(meta["fingerprint"], model_fingerprint(retrained), "ckpt")
    assert changed_on_resume(run.model, retrained) == [
        f"extra.hidden_dropout: checkpoint {run.model.extra.get('hidden_dropout')!r} -> this "
        "run 0.1",
        f"extra.moe_aux_loss_coeff: checkpoint {run.model.extra.get('moe_aux_loss_coeff')!r} "
        "-> this run 0.05"]
    normed = dataclasses.replace(run.model, extra={**run.model.extra, "qk_layernorm": True})
    with pytest.raises(CheckpointError, match="differing fields: extra: .*qk_layernorm"):
        check_fingerprint(meta["fingerprint"], model_fingerprint(normed), "ckpt")
