"""training/startup.py: the run's Start (tokenizer, vocabulary, validated Megatron config)
built once, and the RunConfig it is given left exactly as it was."""

import pytest

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.training.startup import start_up

pytestmark = pytest.mark.timeout(60)

# Megatron-LM's way: mock data, NullTokenizer, --vocab-size (the tokenizer's, without EOD).
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--ffn-hidden-size", "64", "--num-experts", "2", "--moe-router-topk", "2",
        "--seq-length", "16", "--train-iters", "2", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear"]


def test_start_up_leaves_the_run_config_as_given():
    run = config_from_args(ARGV)
    before = run.to_dict()
    start = start_up(run, world_size=1)
    assert run.to_dict() == before  # the old start-up rewrote both vocab fields in place
    # NullTokenizer: 1000 ids + EOD; the model's vocabulary padded to a multiple of 128.
    assert start.tokenizer.vocab_size == 1001
    assert (start.run.data.null_vocab_size, start.run.model.vocab_size) == (1000, 1024)
    assert start.config.num_moe_experts == 2 and start.run is not run


def test_start_up_without_a_tokenizer_is_the_run_itself():
    run = config_from_args(["--model-preset", "tiny_smoe", "--vocab-size", "512"])
    start = start_up(run, world_size=1)
    assert start.run is run and start.tokenizer is None
    assert start.config.hidden_size == run.model.hidden_size


def _count_tokenizer_builds(rank, world_size, argv):
    """One in-process pretrain step of `argv`; how often the run's tokenizer was built."""
    from megatron_mvmoe.data import run_data
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    builds = []
    real = run_data.build_run_tokenizer

    def counted(run):
        builds.append(run.data.tokenizer_type)
        return real(run)
    run_data.build_run_tokenizer = counted  # this spawned rank only
    run = config_from_args(argv)
    pretrain(run, initialize_layout(run.parallel.layout(), timeout_s=60))
    return builds


def test_a_run_builds_its_tokenizer_once():
    """main's pretrain built it twice more (its own vocabulary pass, then the data's)."""
    from megatron_mvmoe.testing.spawn import run_distributed

    argv = ARGV + ["--train-iters", "1", "--eval-iters", "0", "--tensorboard", "false"]
    builds = run_distributed(_count_tokenizer_builds, 1, timeout_s=120, args=(argv,))[0]
    assert builds == ["NullTokenizer"]
