"""Every user mistake with the data fails early, naming the file and the fix."""

import json
import os
import shutil

import pytest

from megatron_mvmoe.data.errors import DataError
from megatron_mvmoe.data.indexed import check_indexed, write_indexed
from megatron_mvmoe.data.loader import DataConfig, build_datasets
from megatron_mvmoe.data.preprocess import PreprocessConfig, preprocess


@pytest.fixture
def copy(data_dir, tmp_path):
    """A private copy of the tokenized directory to break."""
    dst = tmp_path / "tok"
    shutil.copytree(data_dir, dst, ignore=shutil.ignore_patterns("cache"))
    return str(dst)


def _config(data_dir):
    return DataConfig(data_dir=data_dir, seq_length=16, micro_batch_size=2,
                      global_batch_size=2, train_samples=8)


def _truncate(path, keep_bytes_less):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - keep_bytes_less)


def test_intact_copy_loads(copy):
    assert len(build_datasets(_config(copy)).train) >= 8


def test_missing_bin(copy):
    os.remove(os.path.join(copy, "tech_valid.bin"))
    with pytest.raises(DataError, match=r"tech_valid\.bin: indexed dataset file missing.*"
                                        r"preprocess_data\.py"):
        build_datasets(_config(copy))


def test_missing_idx(copy):
    os.remove(os.path.join(copy, "books_train.idx"))
    with pytest.raises(DataError, match=r"books_train\.idx: indexed dataset file missing"):
        build_datasets(_config(copy))


def test_truncated_bin(copy):
    _truncate(os.path.join(copy, "reference_train.bin"), 2)
    with pytest.raises(DataError, match=r"reference_train\.bin: truncated or corrupt \.bin"):
        build_datasets(_config(copy))


def test_truncated_idx(copy):
    _truncate(os.path.join(copy, "books_test.idx"), 8)
    with pytest.raises(DataError, match=r"books_test\.idx: truncated or corrupt \.idx"):
        build_datasets(_config(copy))


def test_corrupt_idx_magic_and_pointers(copy):
    path = os.path.join(copy, "tech_test.idx")
    with open(path, "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(DataError, match=r"tech_test\.idx: not a Megatron \.idx"):
        check_indexed(path[:-4])
    prefix = os.path.join(copy, "tiny")
    write_indexed(prefix, [[1, 2, 3], [4, 5]], eod_id=0, vocab_size=512)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(34 + 2 * 4 + 8)  # second sequence pointer
        f.write((999).to_bytes(8, "little"))
    with pytest.raises(DataError, match="sequence pointers or document marks"):
        check_indexed(prefix)


def test_model_vocab_smaller_than_dataset_vocab(copy):
    with pytest.raises(DataError, match=r"vocab 512\) but the model's vocab size is 256"):
        build_datasets(_config(copy), model_vocab_size=256)


def test_dataset_from_another_tokenizer(copy):
    meta_path = os.path.join(copy, "dataset_meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["tokenizer"]["vocab_sha256"] = "0" * 64  # as if made by a different BPE
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError, match=r"tokenizer mismatch on \['vocab_sha256'\]"):
        build_datasets(_config(copy))


def test_ids_beyond_vocab_without_metadata(tmp_path):
    prefix = str(tmp_path / "big")
    write_indexed(prefix, [[10, 50000, 3]], eod_id=50256, vocab_size=50257)
    with pytest.raises(DataError, match="token id 50256 >= vocab size 4096"):
        check_indexed(prefix, vocab_size=4096)


def test_missing_metadata(copy):
    os.remove(os.path.join(copy, "dataset_meta.json"))
    with pytest.raises(DataError, match="dataset_meta.json: dataset metadata missing"):
        build_datasets(_config(copy))


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    write_indexed(prefix, [], eod_id=0, vocab_size=512)
    with pytest.raises(DataError, match="empty dataset"):
        check_indexed(prefix)


def test_empty_corpus_file(corpus_dir, tmp_path):
    broken = tmp_path / "corpus"
    shutil.copytree(corpus_dir, broken)
    open(broken / "tech.valid.jsonl", "w").close()
    with pytest.raises(DataError, match=r"tech\.valid\.jsonl: empty corpus file"):
        preprocess(PreprocessConfig(corpus_dir=str(broken), out_dir=str(tmp_path / "t"),
                                    tokenizer="gpt2"))


def test_missing_corpus(tmp_path):
    with pytest.raises(DataError, match="manifest.json: corpus manifest missing"):
        preprocess(PreprocessConfig(corpus_dir=str(tmp_path), out_dir=str(tmp_path / "t")))


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path"])
def test_missing_data_prefix_is_named_not_the_tokenizer(tmp_path, flag):
    """A mistyped --data-path was reported as a missing tokenizer ("no tokenizer/ beside the
    data"); it is named as a missing data prefix, before the tokenizer is looked for."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.data.run_data import resolve_tokenizer

    prefix = str(tmp_path / "nowhere" / "corpus_text_document")
    unset = [] if flag == "--data-path" else ["--unset", "data.path"]  # the YAML's directory
    run = config_from_args(["--config", "examples/tiny_cpu.yaml", *unset, flag, prefix])
    with pytest.raises(ValueError) as info:
        resolve_tokenizer(run)
    assert str(info.value).startswith(
        f"{flag}: data prefix '{prefix}' not found (no {prefix}.bin or {prefix}.idx). Fix: ")
