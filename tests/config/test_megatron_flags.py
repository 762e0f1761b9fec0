"""Megatron-LM flag names with Megatron-LM's meaning; refused flags say why and what to use."""

import pytest
from megatron_mvmoe.config.flags import build_parser, config_from_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "512",
        # Megatron-LM builds GeLU/LayerNorm/learned/tied without these (refused otherwise)
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_ffn_hidden_size_sets_the_expert_width_unless_given():
    model = config_from_args(BASE + ["--num-experts", "4", "--ffn-hidden-size", "96"]).model
    assert model.moe_variant == "smoe" and model.moe_ffn_hidden_size == 96
    model = config_from_args(BASE + ["--num-experts", "4", "--ffn-hidden-size", "96",
                                      "--moe-ffn-hidden-size", "32"]).model
    assert model.moe_ffn_hidden_size == 32 and model.ffn_hidden_size == 96
    assert config_from_args(BASE + ["--ffn-hidden-size", "96"]).model.moe_variant == "dense"


def test_megatron_switches_and_transformer_fields_map():
    run = config_from_args(BASE + [
        "--ffn-hidden-size", "96", "--bf16", "--no-load-optim", "--lr-decay-style", "linear",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.02",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--init-method-std", "0.01", "--rotary-base", "1000000", "--swiglu",
        "--tensorboard-dir", "/tmp/tb", "--data-path", "0.3", "A", "0.7", "B",
        "--split", "99,1,0", "--data-cache-path", "/tmp/c", "--tokenizer-type",
        "NullTokenizer", "--make-vocab-size-divisible-by", "64"])
    assert run.training.precision == "bf16" and run.training.load_optimizer is False
    assert run.optimizer.lr_decay_style == "linear"
    assert run.model.extra == {"moe_router_load_balancing_type": "seq_aux_loss",
                               "moe_aux_loss_coeff": 0.02,
                               "moe_router_score_function": "sigmoid",
                               "moe_router_enable_expert_bias": True,
                               "init_method_std": 0.01,
                               # Megatron-LM's parser defaults for absent flags on a
                               # Megatron-LM style line (megatron_lm_rules._PARSER_DEFAULTS)
                               "attention_dropout": 0.1, "hidden_dropout": 0.1,
                               "moe_router_dtype": None, "attention_softmax_in_fp32": False,
                               "moe_token_dispatcher_type": "allgather"}
    assert run.model.rotary_base == 1000000 and run.logging.tensorboard
    assert run.data.path == ["0.3", "A", "0.7", "B"] and run.data.split == "99,1,0"
    assert run.data.megatron_conventions() and run.data.make_vocab_size_divisible_by == 64


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "e4m3"], "--fp8-format: not supported: FP8 needs TransformerEngine.*"
                               "Use instead: --bf16"),
    (["--num-layers-per-virtual-pipeline-stage", "2"],
     "not supported.*--virtual-pipeline-model-parallel-size"),
    (["--position-embedding-type", "mrope"],
     "model.position_embedding_type: unknown 'mrope'.*rope, learned_absolute"),
    (["--max-position-embeddings", "16"],
     r"^model.max_position_embeddings: 16 is below seq_length 32.*--max-position-embeddings"),
    (["--lr-decay-styl", "cosine"], "unknown flag.*did you mean --lr-decay-style"),
    (["--lr-decay", "cosine"], "unknown flag"),  # no prefix matching onto --lr-decay-iters
])
def test_refused_flags_say_why_and_what_instead(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(BASE + argv)


def test_help_lists_every_flag_with_whole_sentences():
    text = build_parser().format_help()
    for flag in ("--data-path", "--split", "--tokenizer-type", "--mock-data", "--bf16",
                 "--no-load-optim", "--sequence-parallel", "--moe-grouped-gemm",
                 "--data-loader", "--wandb-project"):
        assert flag in text
