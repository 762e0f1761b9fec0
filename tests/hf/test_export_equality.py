"""Exported directories compute our model: for every variant (and BitNet), for models with
Megatron-LM's QK layer norm, multi-latent attention (YaRN), group-limited routing and
shared-expert gates (issue 36), and for source
checkpoints saved at EP=2 and at TP=2 x PP=2 x EP=2, AutoModelForCausalLM.from_pretrained
(trust_remote_code=True) in fp32 on CPU gives logits within 1e-5 of ours on held-out text,
and its greedy generate() gives the tokens of tools/generate.py's generation code (the tool
itself once, through the exported tokenizer)."""

import json
import os
import subprocess
import sys

import pytest

from hf_helpers import (SIGMOID_SHARED, export_and_run_ours, held_out_ids,
                        hf_logits_and_tokens, prefixes, train_checkpoint)
from megatron_mvmoe.testing.spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)
TOLERANCE = 1e-5
NEW_TOKENS = 12

CASES = {  # name: (preset, extra flags, class auto must choose)
    "dense": ("tiny_dense", [], "LlamaForCausalLM"),
    "smoe": ("tiny_smoe", [], "MixtralForCausalLM"),
    "smoe_sigmoid_shared": ("tiny_smoe", SIGMOID_SHARED, "Glm4MoeForCausalLM"),
    "smoe_qk_norm": ("tiny_smoe", ["--qk-layernorm"], "Qwen3MoeForCausalLM"),
    "latent": ("tiny_latent", [], "MVMoEForCausalLM"),
    "multi_router": ("tiny_multi_router", [], "MVMoEForCausalLM"),
    "multi_view": ("tiny_multi_view", [], "MVMoEForCausalLM"),
    "mh_moe": ("tiny_mh_moe", [], "MVMoEForCausalLM"),
    "multi_view_bitnet": ("tiny_multi_view", ["--bitnet"], "MVMoEForCausalLM"),
    "mh_moe_bitnet": ("tiny_mh_moe", ["--bitnet"], "MVMoEForCausalLM"),
    # DeepSeek-style: MLA (q through a normalised latent, YaRN x2), QK norm, sigmoid routing
    # limited to 1 of 2 expert groups, a gated shared expert (TopKRouter's group path)
    "mla_qk_norm_group_limited": ("tiny_smoe", [
        "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "32", "--kv-lora-rank",
        "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
        "--rotary-scaling-factor", "2", "--moe-router-num-groups", "2",
        "--moe-router-group-topk", "1", *SIGMOID_SHARED], "MVMoEForCausalLM"),
    # QK norm on standard attention, the Multi-Router's group path, a gated shared expert
    "multi_view_qk_norm_group_limited": ("tiny_multi_view", [
        "--qk-layernorm", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-shared-expert-intermediate-size", "128"], "MVMoEForCausalLM"),
}
GATED = {"mla_qk_norm_group_limited", "multi_view_qk_norm_group_limited"}
"""Cases trained with moe_shared_expert_gate (model.extra: no trainer flag sets it)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prefixes(str(tmp_path_factory.mktemp("hf_data")))


def _check_equal(data, root, out, hf_class="auto"):
    ids = held_out_ids(data)
    summary, ours, our_tokens = run_distributed(
        export_and_run_ours, 1, timeout_s=300,
        args=(root, out, hf_class, ids, NEW_TOKENS))[0]
    model, theirs, their_tokens = hf_logits_and_tokens(out, ids, NEW_TOKENS)
    diff = float((theirs - ours).abs().max())
    print(f"{os.path.basename(root)}: {summary['hf_class']} max|logit diff| = {diff:.3g}")
    assert diff < TOLERANCE, (summary, diff)
    assert float(ours.abs().max()) > 0.1  # real logits, not zeros on both sides
    assert their_tokens == our_tokens, (their_tokens, our_tokens)
    return summary, model


@pytest.mark.parametrize("name", list(CASES))
def test_every_variant_exports_with_equal_logits(data, tmp_path, name):
    preset, flags, expected_class = CASES[name]
    extra = {"moe_shared_expert_gate": True} if name in GATED else None
    root = train_checkpoint(str(tmp_path / "ck"), data, preset, flags, extra=extra)
    summary, model = _check_equal(data, root, str(tmp_path / "hf"))
    assert summary["hf_class"] == expected_class
    assert type(model).__name__ == expected_class
    if expected_class == "MVMoEForCausalLM":  # the remote code imports nothing of ours
        assert _imported_modules(tmp_path / "hf") <= {
            "torch", "transformers", "typing", "__future__", "routing", "mixing",
            "quantize", "configuration_mvmoe", "mla_attention", "math", "basic_layers",
            "moe_layers"}


def _imported_modules(directory):
    """Top-level modules the directory's .py files import (relative ones by file name)."""
    import ast

    found = set()
    for path in directory.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.add((node.module or "").split(".")[0])
    return found


def test_the_export_copies_every_remote_file_and_what_each_imports(tmp_path):
    """transformers loads the exported directory flat: every hf/remote/ file is copied, and
    every relative import of a copied file names a copied file (no training needed)."""
    import ast

    from megatron_mvmoe.hf.writer import REMOTE_DIR, copy_remote_code

    copy_remote_code(str(tmp_path))
    copied = {path.stem for path in tmp_path.glob("*.py")}
    assert {path.stem for path in REMOTE_DIR.glob("*.py")} <= copied
    relative = {node.module for path in tmp_path.glob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert relative <= copied, relative - copied


def test_stock_model_exported_as_our_class_too(data, tmp_path):
    root = train_checkpoint(str(tmp_path / "ck"), data, "tiny_smoe")
    summary, _ = _check_equal(data, root, str(tmp_path / "hf"), hf_class="mvmoe")
    assert summary["hf_class"] == "MVMoEForCausalLM"


def test_ep2_source_checkpoint(data, tmp_path):
    root = train_checkpoint(str(tmp_path / "ck"), data, "tiny_multi_view",
                            ["--expert-model-parallel-size", "2"], world=2)
    _check_equal(data, root, str(tmp_path / "hf"))


def test_tp2_pp2_source_checkpoint(data, tmp_path):
    root = train_checkpoint(str(tmp_path / "ck"), data, "tiny_multi_view",
                            ["--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2",
                             "--expert-model-parallel-size", "2"], world=4, timeout_s=400)
    _check_equal(data, root, str(tmp_path / "hf"))


def test_generate_tool_tokens_equal_hf_generate(data, tmp_path):
    """tools/generate.py on the checkpoint vs generate() on the export, through the
    exported tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = train_checkpoint(str(tmp_path / "ck"), data, "tiny_multi_view")
    out = str(tmp_path / "hf")
    subprocess.run([sys.executable, "tools/export_hf.py", "--load", root, "--out", out],
                   check=True, capture_output=True, timeout=300)
    prompt = "The hacker's dictionary says"
    proc = subprocess.run([sys.executable, "tools/generate.py", "--load", root, "--prompt",
                           prompt, "--max-new-tokens", str(NEW_TOKENS), "--no-stop-at-eod",
                           "--json"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    tool_tokens = json.loads(proc.stdout[proc.stdout.index("{"):])["outputs"][0]["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                 dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None  # as --no-stop-at-eod
    generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert generated[0, ids.shape[1]:].tolist() == tool_tokens
