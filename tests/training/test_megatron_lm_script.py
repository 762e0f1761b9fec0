"""A real Megatron-LM MoE launch script runs here with only the launcher prefix, the paths
and the sizes changed.

The script is NVIDIA/Megatron-LM `examples/mixtral/train_mixtral_8x7b_distributed.sh`
(commit 9b8acfd0dbf72a3c831ddff8e2c07c48b59f3901). Its file is not copied into this repository:
the test below builds the same command line, array by array in the script's order, from the
flag names, with these changes only:
- launcher: `torchrun ... pretrain_gpt.py` -> `torchrun ... -m megatron_mvmoe.training.pretrain`,
  GPUS_PER_NODE 8 -> 2;
- paths: CHECKPOINT_PATH, TOKENIZER_MODEL (a sentencepiece model trained here on the Jargon
  File, Llama2Tokenizer as in the script), DATA_PATH (a prefix written by Megatron-Core's
  IndexedDatasetBuilder);
- sizes: seq 4096 -> 64, 32 layers -> 2, hidden 4096 -> 64, FFN 14336 -> 128, 32 heads -> 4,
  8 query groups -> 2, 8 experts -> 4, global batch 256 -> 4, 500000 iters -> 4 (decay 320000
  -> 4, warmup 500 -> 1), PP 4 -> 1, EP 8 -> 2, save/eval interval 10000/1000 -> 2,
  eval iters 10 -> 1.
Everything else (--bf16, --sequence-parallel, --moe-grouped-gemm, --overlap-*, --no-load-optim,
--no-load-rng, --rotary-base 1000000, --split 99990,8,2, ...) is passed as the script passes it.
"""

import gzip
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)
sentencepiece = pytest.importorskip("sentencepiece")


def _tokenizer_and_data(tmp):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    # One document per line: --split 99990,8,2 needs > 12500 documents for one validation
    # document, as it would in Megatron-LM.
    text = gzip.open("/usr/share/dictd/jargon.dict.dz", "rt", errors="ignore").read()
    docs = [line.strip() for line in text.splitlines() if len(line.strip()) > 20]
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as fh:
        fh.write("\n".join(d.replace("\n", " ") for d in docs))
    sentencepiece.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(
        tmp, "tokenizer"), vocab_size=500, model_type="bpe", minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(tmp, "tokenizer.model"))
    prefix = os.path.join(tmp, "jargon_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(500))
    for ids in sp.encode(docs):
        builder.add_document(ids + [sp.eos_id()], [len(ids) + 1])
    builder.finalize(prefix + ".idx")
    return os.path.join(tmp, "tokenizer.model"), prefix


def _script_line(checkpoint_path, tokenizer_model, data_path, port):
    distributed_args = ["--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0",
                        "--master_addr", "localhost", "--master_port", str(port)]
    model_args = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "64",
                  "--max-position-embeddings", "32768", "--num-layers", "2",
                  "--hidden-size", "64", "--ffn-hidden-size", "128",
                  "--num-attention-heads", "4", "--init-method-std", "0.01",
                  "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                  "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                  "--swiglu", "--untie-embeddings-and-output-weights",
                  "--group-query-attention", "--num-query-groups", "2",
                  "--no-masked-softmax-fusion", "--no-position-embedding",
                  "--rotary-base", "1000000"]
    moe_args = ["--num-experts", "4", "--moe-router-topk", "2",
                "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
                "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
                "--overlap-param-gather", "--overlap-grad-reduce"]
    data_args = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_model,
                 "--data-path", data_path, "--split", "99990,8,2"]
    training_args = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
                     "--train-iters", "4", "--lr-decay-iters", "4", "--lr-decay-style",
                     "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
                     "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16"]
    model_parallel_args = ["--tensor-model-parallel-size", "1",
                           "--pipeline-model-parallel-size", "1",
                           "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                           "--sequence-parallel"]
    logging_args = ["--log-interval", "1", "--save-interval", "2", "--eval-interval", "2",
                    "--eval-iters", "1", "--save", checkpoint_path, "--load", checkpoint_path,
                    "--tensorboard-dir", f"{checkpoint_path}/tensorboard", "--no-load-optim",
                    "--no-load-rng"]
    return ([sys.executable, "-m", "torch.distributed.run", *distributed_args,
             "-m", "megatron_mvmoe.training.pretrain"] + model_args + moe_args + data_args +
            training_args + model_parallel_args + logging_args)


def test_mixtral_example_script_runs_on_cpu(tmp_path):
    from megatron_mvmoe.testing.spawn import free_port

    tokenizer_model, data_path = _tokenizer_and_data(str(tmp_path))
    checkpoint_path = str(tmp_path / "checkpoints")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(_script_line(checkpoint_path, tokenizer_model, data_path,
                                       free_port()), env=env, capture_output=True, text=True,
                          timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step      4/4" in out and "eval step 4: jargon_text_document loss" in out, out[-3000:]
    assert "no checkpoint yet" in out  # --load = --save on a fresh job, as Megatron-LM allows
    assert os.path.isfile(os.path.join(checkpoint_path, "latest"))
    assert os.listdir(os.path.join(checkpoint_path, "tensorboard"))
    assert "note: --moe-grouped-gemm:" in out  # every accepted-as-is flag says what it meant
