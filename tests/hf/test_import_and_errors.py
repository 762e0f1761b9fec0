"""tools/import_hf.py: export -> import is bit-identical (our class and a stock class), the
trainer resumes from the imported checkpoint at another layout, and bad input (an unknown
variant, a missing shard, a layout that cannot be gathered, an HF config that does not
match its weights) is one line naming the file or field, with nothing written."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hf_helpers import SIGMOID_SHARED, prefixes, train_checkpoint
from megatron_mvmoe.testing.spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prefixes(str(tmp_path_factory.mktemp("hf_data")))


@pytest.fixture(scope="module")
def multi_view(data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mv") / "ck")
    return train_checkpoint(root, data, "tiny_multi_view")


@pytest.fixture(scope="module")
def qwen3_moe(data, tmp_path_factory):
    """smoe with QK norm (exports as Qwen3-MoE): trained once for every test of a stock class."""
    root = str(tmp_path_factory.mktemp("qwen3_moe") / "ck")
    return train_checkpoint(root, data, "tiny_smoe", ["--qk-layernorm"])


@pytest.fixture(scope="module")
def exported(multi_view, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exported") / "hf")
    _ok("export_hf", "--load", multi_view, "--out", out)
    return out


def _tool(name, *args):
    return subprocess.run([sys.executable, f"tools/{name}.py", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)


def _ok(name, *args):
    proc = _tool(name, *args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def _refused(name, *args):
    proc = _tool(name, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def _weights(rank, world_size, roots):
    from megatron_mvmoe.hf.export import read_checkpoint

    return [read_checkpoint(root).state for root in roots]


def _assert_bit_identical(a, b):
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == [], different


@pytest.mark.parametrize("trained,hf_class", [
    ("multi_view", "MVMoEForCausalLM"), (SIGMOID_SHARED, "Glm4MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM")], ids=["mvmoe", "glm4_moe", "qwen3_moe"])
def test_export_import_is_bit_identical(request, data, tmp_path, trained, hf_class):
    """`trained`: a module fixture's checkpoint, or the flags of a tiny_smoe trained here."""
    root = (request.getfixturevalue(trained) if isinstance(trained, str) else
            train_checkpoint(str(tmp_path / "ck"), data, "tiny_smoe", trained))
    out, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    exported = _ok("export_hf", "--load", root, "--out", out, "--max-shard-size", "500KB")
    assert exported["hf_class"] == hf_class
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded, read back through the index
    summary = _ok("import_hf", "--hf", out, "--save", imported,
                  "--expert-model-parallel-size", "2")
    assert summary["source_step"] == 3
    original, back = run_distributed(_weights, 1, timeout_s=300, args=([root, imported],))[0]
    _assert_bit_identical(original, back)


def _imported_run(imported, data, **training):
    with open(os.path.join(imported, "latest")) as fh:
        state = json.load(open(os.path.join(imported, fh.read().strip(), "run_state.json")))
    raw = state["config"]
    raw["training"].update(load=imported, save=None, eval_iters=0, global_batch_size=4,
                           micro_batch_size=2, **training)
    raw["data"].update(path=[data["tech"]], split="90,10,0")
    raw["logging"]["log_interval"] = 1
    return state, raw


def test_training_resumes_from_the_imported_checkpoint_at_ep2(data, exported, tmp_path, capfd):
    """... with the source run's LR schedule (hf_helpers: lr 1e-2, min 1e-3, 3 steps of
    decay, saved at step 3), not the import's placeholder (lr 1e-3 over 100 steps, issue
    35): the warning names what is kept and the steps run at the source's min_lr."""
    from harness import train
    from megatron_mvmoe.config.run_config import config_from_dict

    imported = str(tmp_path / "imported")
    assert _ok("import_hf", "--hf", exported, "--save", imported)["schedule"] == (
        "the source run's")
    state, raw = _imported_run(imported, data, train_iters=2)
    assert {k: state["scheduler"][k] for k in ("max_lr", "min_lr", "lr_decay_steps",
                                               "num_steps")} == {
        "max_lr": 1e-2, "min_lr": 1e-3, "lr_decay_steps": 3, "num_steps": 3}
    raw["parallel"]["ep"] = 2
    config_from_dict(raw)  # the imported run config is a valid run
    result = train(raw, 2)
    assert result["first_step"] == 1 and len(result["losses"]) == 2
    assert all(3.0 < loss < 8.0 for loss in result["losses"]), result["losses"]
    log = capfd.readouterr().out
    assert "warning: resume keeps the checkpoint's LR/WD schedule" in log
    assert "max_lr: checkpoint 0.01 vs this run 0.001" in log
    assert [line.split("| lr ")[1][:9] for line in log.splitlines()
            if line.startswith("step ")] == ["1.000e-03", "1.000e-03"]


def test_an_import_without_a_recorded_schedule_resumes_with_the_runs(data, exported, tmp_path,
                                                                     capfd):
    """An export that recorded no schedule (older ones, stock HF directories): the import
    carries none, and the resume takes the run's schedule and says so."""
    from harness import train

    out, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    shutil.copytree(exported, out)
    config = json.load(open(os.path.join(out, "config.json")))
    del config["megatron_mvmoe_source"]["scheduler"]
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    assert _ok("import_hf", "--hf", out, "--save", imported)["schedule"] == "none"
    state, raw = _imported_run(imported, data, train_iters=1)
    assert "scheduler" not in state
    assert train(raw, 1)["first_step"] == 1
    notes = [line for line in capfd.readouterr().out.splitlines() if "LR/WD schedule" in line]
    assert len(notes) == 1 and notes[0].startswith("resume: ") and (
        "carries no LR/WD schedule (weights only); this run's schedule applies from step 0: "
        "max_lr 0.001, min_lr 0.0001, lr_warmup_steps 0, lr_decay_steps 1") in notes[0]


def test_unknown_variant_is_refused(multi_view, tmp_path):
    import shutil

    root = str(tmp_path / "ck")
    shutil.copytree(multi_view, root)
    step_dir = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    path = os.path.join(step_dir, "run_state.json")
    state = json.load(open(path))
    state["config"]["model"]["moe_variant"] = "mystery_moe"
    json.dump(state, open(path, "w"))
    line = _refused("export_hf", "--load", root, "--out", str(tmp_path / "hf"))
    assert "moe_variant" in line and "Fix:" in line, line
    assert not os.path.exists(tmp_path / "hf")


def test_missing_shard_is_refused(multi_view, tmp_path):
    import shutil

    root = str(tmp_path / "ck")
    shutil.copytree(multi_view, root)
    step_dir = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    shard = sorted(f for f in os.listdir(step_dir) if f.endswith(".distcp"))[0]
    os.remove(os.path.join(step_dir, shard))
    line = _refused("export_hf", "--load", root, "--out", str(tmp_path / "hf"))
    assert shard in line and "Fix:" in line, line
    assert not os.path.exists(tmp_path / "hf")
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]


def test_layout_that_cannot_be_gathered_is_refused(multi_view, tmp_path):
    """Several ranks: the export gathers on one process."""
    from megatron_mvmoe.testing.spawn import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), "tools/export_hf.py",
                           "--load", multi_view, "--out", str(tmp_path / "hf")], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "world size" in proc.stderr and "Fix: run it without torchrun" in proc.stderr
    assert not os.path.exists(tmp_path / "hf")


def test_hf_config_that_does_not_match_is_refused(exported, tmp_path):
    out = str(tmp_path / "hf")
    shutil.copytree(exported, out)
    config = json.load(open(os.path.join(out, "config.json")))
    config["megatron_mvmoe"]["latent_size"] = 16  # the weights are 32 wide
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    line = _refused("import_hf", "--hf", out, "--save", str(tmp_path / "imported"))
    assert "linear_fc1.weight: shape (128, 32) but config.json gives (128, 16)" in line, line
    assert "Fix:" in line
    assert not os.path.exists(tmp_path / "imported")
    config["hidden_size"] = 96
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    line = _refused("import_hf", "--hf", out, "--save", str(tmp_path / "imported"))
    assert "config.json: hidden_size" in line, line


def test_stock_config_field_we_do_not_express_is_refused(qwen3_moe, tmp_path):
    out = str(tmp_path / "hf")
    assert _ok("export_hf", "--load", qwen3_moe, "--out", out)["hf_class"] == (
        "Qwen3MoeForCausalLM")
    config = json.load(open(os.path.join(out, "config.json")))
    config["tie_word_embeddings"] = True
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    line = _refused("import_hf", "--hf", out, "--save", str(tmp_path / "imported"))
    assert "config.json: tie_word_embeddings" in line, line


def test_hf_dense_decoder_seeds_an_upcycled_warm_start_or_is_refused(data, tmp_path):
    """A Llama directory imports as our dense model; --warm-start-from it with
    --moe-use-upcycling trains an MoE of the same shape, and a shape that differs is refused
    naming the field."""
    from harness import train
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.toolkit.checkpoint import checkpoint_run_config
    from megatron_mvmoe.training.warm_start import check_dense_source

    dense = train_checkpoint(str(tmp_path / "dense"), data, "tiny_dense")
    out, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    assert _ok("export_hf", "--load", dense, "--out", out)["hf_class"] == "LlamaForCausalLM"
    _ok("import_hf", "--hf", out, "--save", imported)
    run = checkpoint_run_config(imported)
    target = model_from_preset("tiny_smoe", vocab_size=run.model.vocab_size, seq_length=32)
    check_dense_source(run.model, target, imported, run.parallel)  # fits
    wider = model_from_preset("tiny_smoe", vocab_size=run.model.vocab_size, seq_length=32,
                              hidden_size=96, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"hidden_size: checkpoint 64 vs this run 96"):
        check_dense_source(run.model, wider, imported, run.parallel)
    raw = run.to_dict()
    raw["model"] = {"preset": "tiny_smoe", "vocab_size": run.model.vocab_size,
                    "seq_length": 32}
    raw["training"].update(warm_start_from=imported, moe_use_upcycling=True, save=None,
                           load=None, train_iters=1, eval_iters=0, global_batch_size=4,
                           micro_batch_size=2)
    raw["data"].update(path=[data["tech"]], split="90,10,0")
    result = train(raw, 1)
    assert len(result["losses"]) == 1 and 3.0 < result["losses"][0] < 8.0, result


def test_a_renamed_weight_is_named_both_missing_and_unexpected(exported, tmp_path):
    """The import error names the weight the model misses and the one it does not know."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path / "hf")
    shutil.copytree(exported, out)
    shard = os.path.join(out, sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))[0])
    tensors = load_file(shard)
    old = "model.decoder.layers.0.pre_mlp_layernorm.weight"
    tensors["model.decoder.layers.0.post_attention_layernorm.weight"] = tensors.pop(old)
    save_file(tensors, shard, metadata={"format": "pt"})
    line = _refused("import_hf", "--hf", out, "--save", str(tmp_path / "imported"))
    assert "1 [decoder.layers.0.pre_mlp_layernorm.weight] the config's model needs are " \
        "missing; 1 [decoder.layers.0.post_attention_layernorm.weight] in the directory " \
        "have no place" in line, line
    assert not os.path.exists(tmp_path / "imported")


def _export_in_bf16(rank, world_size, root, out, umask):
    """The checkpoint's weights as a bf16 run holds them, exported under `umask`."""
    import dataclasses

    from megatron_mvmoe.hf.export import export_loaded, read_checkpoint

    ckpt = read_checkpoint(root)
    state = {k: v.bfloat16() if v.is_floating_point() else v for k, v in ckpt.state.items()}
    previous = os.umask(umask)
    try:
        return export_loaded(dataclasses.replace(ckpt, state=state), out)["hf_class"]
    finally:
        os.umask(previous)


def test_exported_files_follow_the_umask_and_config_dtype_is_the_weights(multi_view,
                                                                          exported, tmp_path):
    """safetensors wrote its shards 0600 (unreadable to the group on a shared filesystem),
    and config.json said float32 whatever the weights were."""
    assert json.load(open(os.path.join(exported, "config.json")))["dtype"] == "float32"
    out = str(tmp_path / "hf")
    run_distributed(_export_in_bf16, 1, timeout_s=300, args=(multi_view, out, 0o027))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777)
             for name in os.listdir(out)}
    assert set(modes.values()) == {oct(0o640)}, modes
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True)
    assert model.dtype == torch.bfloat16  # transformers reads the dtype we wrote
