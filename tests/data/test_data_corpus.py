"""Corpus building: real sources, manifest integrity, disjoint deterministic splits."""

import hashlib
import json
import os

import pytest

from megatron_mvmoe.data.corpus import (SPLITS, CorpusConfig, build_corpus, iter_texts,
                                        load_manifest, split_of)
from megatron_mvmoe.data.errors import DataError
from megatron_mvmoe.data.sources import (DOMAINS, Document, SourcePaths, _b64_number,
                                         chunk_text)


def test_manifest_matches_files(corpus_dir):
    manifest = load_manifest(corpus_dir)
    assert set(manifest["domains"]) == set(DOMAINS)
    for domain in DOMAINS:
        for split in SPLITS:
            entry = manifest["files"][f"{domain}.{split}"]
            path = os.path.join(corpus_dir, entry["path"])
            with open(path, "rb") as f:
                blob = f.read()
            assert hashlib.sha256(blob).hexdigest() == entry["sha256"]
            assert len(blob) == entry["bytes"]
            lines = blob.decode("utf-8").splitlines()
            assert len(lines) == entry["docs"] > 0
            first = json.loads(lines[0])
            assert first["domain"] == domain and first["text"] and first["source"]


def test_every_source_contributes(corpus_dir):
    manifest = load_manifest(corpus_dir)
    for name, source in manifest["sources"].items():
        assert source["splits"]["train"]["docs"] > 0, name


def test_held_out_documents_never_in_train(corpus_dir):
    for domain in DOMAINS:
        train = set(iter_texts(corpus_dir, domain, "train"))
        valid = set(iter_texts(corpus_dir, domain, "valid"))
        test = set(iter_texts(corpus_dir, domain, "test"))
        assert not train & valid and not train & test and not valid & test


def test_split_is_a_pure_function_of_source_and_key():
    config = CorpusConfig(out_dir="unused")
    docs = [Document(f"text {i}", "books", "kjv", f"key{i}") for i in range(3000)]
    splits = [split_of(d, config) for d in docs]
    # Same key, other text: same split (the text is not part of the hash).
    assert splits == [split_of(Document("x", d.domain, d.source, d.key), config) for d in docs]
    share = {s: splits.count(s) / len(splits) for s in SPLITS}
    assert 0.01 < share["valid"] < 0.03 and 0.01 < share["test"] < 0.03
    other = CorpusConfig(out_dir="unused", split_seed=99)
    assert splits != [split_of(d, other) for d in docs]


def test_rebuild_is_identical(corpus_dir, tmp_path):
    again = build_corpus(CorpusConfig(out_dir=str(tmp_path), max_mb_per_domain=0.15))
    first = load_manifest(corpus_dir)
    assert {k: v["sha256"] for k, v in again["files"].items()} == \
           {k: v["sha256"] for k, v in first["files"].items()}


def test_chunk_text_keeps_paragraphs_and_limit():
    paras = [f"paragraph {i} " + "word " * (i % 7 + 1) for i in range(50)]
    text = "\n\n".join(paras)
    pieces = chunk_text(text, 120)
    assert all(len(p) <= 120 for p in pieces)
    assert "\n\n".join(pieces) == text


def test_dictd_base64_numbers():
    # dictd index numbers are base 64, most significant digit first: B=1, A=0, /=63.
    assert _b64_number("B") == 1
    assert _b64_number("BA") == 64
    assert _b64_number("/") == 63
    assert _b64_number("Gb9L") == ((6 * 64 + 27) * 64 + 61) * 64 + 11


def test_missing_source_names_the_package(tmp_path):
    paths = SourcePaths(dictd_dir=str(tmp_path / "nothing"))
    with pytest.raises(DataError, match="apt-get install dict-gcide"):
        build_corpus(CorpusConfig(out_dir=str(tmp_path / "c"), paths=paths,
                                  max_mb_per_domain=0.05))
    paths = SourcePaths(python_doc_dir=str(tmp_path))
    with pytest.raises(DataError, match="apt-get install python3.11-doc"):
        build_corpus(CorpusConfig(out_dir=str(tmp_path / "c"), paths=paths,
                                  max_mb_per_domain=0.05))
    paths = SourcePaths(bible_command=str(tmp_path / "no-bible"))
    with pytest.raises(DataError, match="bible-kjv"):
        build_corpus(CorpusConfig(out_dir=str(tmp_path / "c"), paths=paths,
                                  max_mb_per_domain=0.05))
    assert not os.path.exists(tmp_path / "c" / "manifest.json")


def test_unbuilt_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="build_corpus.py"):
        load_manifest(str(tmp_path))


def test_build_corpus_cli_json(tmp_path, capsys, load_tool):
    main = load_tool("build_corpus").main
    assert main(["--out", str(tmp_path), "--max-mb-per-domain", "0.05", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["files"]) == {f"{d}.{s}" for d in DOMAINS for s in SPLITS}
    assert main(["--out", str(tmp_path / "x"), "--dictd-dir", str(tmp_path / "none")]) == 2
    assert "apt-get install dict-gcide" in capsys.readouterr().err
