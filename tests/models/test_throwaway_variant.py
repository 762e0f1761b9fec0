"""A variant is one record: a throwaway variant (a subclass-free copy of multi_view's record
under another name, with its builder as a callable) registered from ONE temporary module
builds, trains, ramps gamma, dedups as views and exports to Hugging Face, and that module
imports only what docs/architecture.md "Adding a variant" names, whose file count it states.

Measured: 45 s on the shared 2-core machine under load (3 training steps, one export, one
HF forward; the session token set shared with the other training tests)."""

import ast
import copy
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.config.variants import VARIANTS
from megatron_mvmoe.testing.spawn import run_distributed

from harness import tiny_run

NAME = "throwaway_view"
MODULE = f'''"""The throwaway variant: one record, its builder a callable (Multi-View's layer)."""
import dataclasses

from megatron_mvmoe.config.variants import VARIANTS, register_variant
from megatron_mvmoe.models.specs import multi_view_layer


def build_layer(config, moe_spec, variant):
    return multi_view_layer(config, moe_spec, variant)


VARIANT = register_variant(dataclasses.replace(VARIANTS["multi_view"], name="{NAME}",
                                               moe_layer=build_layer))
'''
IDS = [(7 * i + 3) % 500 + 1 for i in range(24)]
DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """The temporary module imported (so registered) for this module's tests, then gone."""
    directory = tmp_path_factory.mktemp("throwaway")
    (directory / "throwaway_variant.py").write_text(MODULE)
    sys.path.insert(0, str(directory))
    try:
        importlib.import_module("throwaway_variant")
        yield directory
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("throwaway_variant", None)
        VARIANTS.pop(NAME, None)


def _train_watching_layers(rank, world_size, raw):
    """pretrain, recording each step's gamma and every ramped layer's dispatcher."""
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain
    from megatron_mvmoe.views.protocols import gamma_ramped

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(), timeout_s=60)
    seen = []

    def on_step(step, trainer):
        layers = [m for chunk in trainer.unwrapped() for m in gamma_ramped(chunk)]
        seen.append((layers[0].gamma(), sorted({(
            type(m).__name__, type(m.token_dispatcher).__name__, m.token_dispatcher.num_views)
            for m in layers})))
    return pretrain(run, pgs, on_step=on_step).losses, seen


def _export_with_our_logits(rank, world_size, root, out):
    """Load the checkpoint once: export it (as tools/export_hf.py's writing half does; the
    tiny token set has no tokenizer to carry) and take our logits on IDS."""
    from megatron_mvmoe.hf import names
    from megatron_mvmoe.hf.export import LoadedCheckpoint, export_loaded
    from megatron_mvmoe.toolkit.checkpoint import (checkpoint_run_config, load_model,
                                                   tool_session)
    from megatron_mvmoe.toolkit.generation import sequence_logits

    run = checkpoint_run_config(root)
    with tool_session(run) as pgs:
        loaded = load_model(run, root, pgs)
        chunk = loaded.model[0]
        state = names.weights_only(chunk.state_dict())
        summary = export_loaded(LoadedCheckpoint(chunk.config, run.model, state, None,
                                                 loaded.step, None), out, "mvmoe")
        return summary, sequence_logits(chunk, IDS)


def test_throwaway_variant_builds_trains_ramps_dedups_and_exports(registered, text_tokens,
                                                                 tmp_path):
    root, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    raw = tiny_run(text_tokens, train_iters=3, eval_iters=0, save=root, save_interval=3)
    raw["model"].update(moe_variant=NAME, moe_dispatcher="dedup_rank")
    raw["model"]["multi_view"]["gamma_ramp_steps"] = 2
    losses, seen = run_distributed(_train_watching_layers, 1, timeout_s=300,
                                   args=(raw,), daemon=False)[0]
    assert len(losses) == 3 and all(loss == loss for loss in losses), losses
    assert [gamma for gamma, _ in seen] == [0.0, 0.5, 1.0]  # the ramp advances per step
    assert all(layers == [("MultiViewMoELayer", "DedupAlltoAllTokenDispatcher", 2)]
               for _, layers in seen), seen  # every step's layers send K = 2 views

    summary, ours = run_distributed(_export_with_our_logits, 1, timeout_s=300,
                                    args=(root, out))[0]
    config = json.loads((Path(out) / "config.json").read_text())
    assert (summary["variant"], config["moe_variant"]) == (NAME, "multi_view")
    assert config["megatron_mvmoe"]["moe_variant"] == NAME  # the import rebuilds this run
    theirs = _hf_logits(out)
    assert float((theirs - ours).abs().max()) < 1e-5 and float(ours.abs().max()) > 0.1


def _hf_logits(out):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def test_the_variant_touches_only_the_files_the_docs_name(registered):
    """The docs' count is the number of files the throwaway variant needed (its one module,
    as the record with a new layer class adds the layer's module), and that module imports
    only modules the section names."""
    section = DOC.read_text().split("## Adding a variant", 1)[1].split("\n## ", 1)[0]
    count = re.search(r"measured by `tests/models/test_throwaway_variant.py`\): (\d+)",
                      section)
    assert count, "docs/architecture.md 'Adding a variant' states no measured file count"
    written = sorted(p.name for p in registered.iterdir() if p.suffix == ".py")
    assert int(count.group(1)) == len(written) == 1, written
    imported = {node.module for node in ast.walk(ast.parse(MODULE))
                if isinstance(node, ast.ImportFrom) and node.module.startswith("megatron_mvmoe")}
    named = {f"megatron_mvmoe.{path[:-3].replace('/', '.')}"
             for path in re.findall(r"`([\w/]+\.py)`", section)}
    assert imported <= named, imported - named


def test_an_unknown_variant_is_refused_by_the_exported_code_in_one_line(tmp_path,
                                                                          monkeypatch):
    """The exported code (as the exporter copies it) builds no SMoE for a name it lacks."""
    from megatron_mvmoe.hf.writer import copy_remote_code

    package = tmp_path / "exported_mvmoe"
    package.mkdir()
    copy_remote_code(str(package))
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    remote = importlib.import_module("exported_mvmoe.modeling_mvmoe")
    with pytest.raises(ValueError) as err:
        remote.build_mlp(remote.MVMoEConfig(moe_variant=NAME), 0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("moe_variant: ") and NAME in message
