"""tools/preprocess_data.py on any JSONL, like Megatron-LM's: --input --json-keys
--output-prefix --workers, written by Megatron-Core's IndexedDatasetBuilder and read back
by Megatron's IndexedDataset with the ids the tokenizer gives."""

import glob
import json
import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mvmoe.data.jsonl import TokenizerSpec, preprocess_jsonl
from megatron_mvmoe.data.tokenizers import build_tokenizer

TOOL = "tools/preprocess_data.py"


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    paths = sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/tutorial/*.rst.txt"))
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    with open(path, "w") as fh:
        for p in paths[:8]:
            text = open(p, errors="ignore").read()
            fh.write(json.dumps({"text": text[:3000], "title": p.rsplit("/", 1)[-1]}) + "\n")
    return str(path)


def test_jsonl_any_keys_workers_agree_and_ids_match_the_tokenizer(jsonl, tmp_path):
    spec = TokenizerSpec("GPT2BPETokenizer")
    one = preprocess_jsonl(jsonl, ["text", "title"], str(tmp_path / "w1"), spec, workers=1)
    two = preprocess_jsonl(jsonl, ["text", "title"], str(tmp_path / "w2"), spec, workers=2)
    assert one["documents"] == 8 and one["outputs"]["text"]["documents"] == 8
    for key in ("text", "title"):
        a = (tmp_path / f"w1_{key}_document.bin").read_bytes()
        assert a == (tmp_path / f"w2_{key}_document.bin").read_bytes()
    tok = build_tokenizer("GPT2BPETokenizer")
    first = json.loads(open(jsonl).readline())["text"]
    dataset = IndexedDataset(str(tmp_path / "w1_text_document"))
    assert list(dataset[0]) == tok.tokenize(first) + [tok.eod]


def test_tool_cli_json_and_bad_line(jsonl, tmp_path):
    out = subprocess.run([sys.executable, TOOL, "--input", jsonl, "--output-prefix",
                          str(tmp_path / "cli"), "--append-eod", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outputs"]["text"]["documents"] == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    out = subprocess.run([sys.executable, TOOL, "--input", str(bad), "--output-prefix",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "line 2: has no string field 'text'" in out.stderr


def test_lone_surrogate_is_one_line_naming_file_line_and_fix(tmp_path):
    """JSON may escape a lone surrogate; it was a 35-line TypeError from the tokenizer."""
    bad = tmp_path / "surrogate.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n')
    out = subprocess.run([sys.executable, TOOL, "--input", str(bad), "--output-prefix",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: {bad}: line 2: field 'text' holds a lone surrogate '\\ud800' at character 7 "
        "(not valid Unicode). Fix: remove or replace it in the source text (e.g. decode the "
        "original bytes with errors='replace')"], out.stderr


def test_domains_come_from_the_directory_not_a_fixed_list(data_dir, tmp_path):
    import shutil

    from megatron_mvmoe.data.loader import DataConfig, build_datasets

    copy = tmp_path / "two_domains"
    shutil.copytree(data_dir, copy)
    meta_path = copy / "dataset_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["prefixes"] = {k: v for k, v in meta["prefixes"].items() if not k.startswith("tech.")}
    meta_path.write_text(json.dumps(meta))
    config = DataConfig(data_dir=str(copy), seq_length=16, micro_batch_size=2,
                        global_batch_size=4, train_samples=8, eval_samples=4)
    bundle = build_datasets(config)
    assert list(bundle.valid) == ["books", "reference"]
    with pytest.raises(ValueError, match=r"\['tech'\] not in .*Fix: use some of"):
        build_datasets(DataConfig(data_dir=str(copy), seq_length=16, micro_batch_size=2,
                                  global_batch_size=4, train_samples=8, domains=("tech",)))
