"""A Megatron-LM style launch line (no --config / --model-preset) gets Megatron-LM's defaults
for absent flags (its GPT-3 architecture included), or a refusal naming the flag.

The line is Megatron-LM's functional test
tests/functional_tests/test_cases/moe/gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel/model_config.yaml
(NVIDIA/Megatron-LM core_r0.19.0, f8837c04ef6cbef6cdefb8de001aad63178aebbf), MODEL_ARGS in
order, `key: true` as a bare switch, paths replaced."""

import pytest

from megatron_mvmoe.config import flags

GPT3_MOE = """--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir TB --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save CK --load CK --data-path DATA/my-gpt3_00_text_document --vocab-file DATA/vocab.json
--merge-file DATA/merges.txt --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 10000 --eval-interval 1000
--eval-iters 10 --transformer-impl local --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel
--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-router-topk 1
--deterministic-mode --no-gradient-accumulation-fusion --use-mcore-models --ckpt-format
torch_dist --dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all
--data-cache-path CACHE --bf16 --attention-backend unfused --disable-bias-linear
--no-bias-gelu-fusion --log-memory-to-tensorboard --async-save
--use-persistent-ckpt-worker""".split()
EXPLICIT = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights"]


def test_absent_architecture_flags_give_megatron_lm_gpt3_architecture():
    """Without --swiglu / --normalization / --position-embedding-type /
    --untie-embeddings-and-output-weights the line is Megatron-LM's GPT-3 (GeLU, LayerNorm,
    learned positions, tied), at ETP = TP as Megatron-LM (gloo too: it was refused there
    until platform/cpu_uneven_gather.py). The model built from such a line equals
    Megatron-LM's: tests/training/test_gpt3_architecture.py."""
    run = flags.config_from_args(GPT3_MOE)
    assert run.parallel.etp == run.parallel.tp > 1
    m = run.model
    assert (m.swiglu, m.normalization, m.position_embedding_type,
            m.untie_embeddings_and_output_weights, m.add_bias_linear) == \
        (False, "LayerNorm", "learned_absolute", False, False)  # the line disables biases
    assert m.ffn_hidden_size == m.moe_ffn_hidden_size == 4 * 512  # validate_args, GeLU


def test_megatron_lm_defaults_fill_the_rest():
    config = flags.config_from_args(GPT3_MOE + EXPLICIT + ["--expert-tensor-parallel-size", "1"])
    m = config.model
    # Megatron-LM validate_args with --swiglu: int((4h * 2/3) / 64) * 64, by hand for h=512
    assert m.ffn_hidden_size == 1344 and m.moe_ffn_hidden_size == 1344
    assert m.moe_variant == "smoe" and m.extra["moe_router_load_balancing_type"] == "sinkhorn"
    assert m.vocab_size is None and config.data.tokenizer_type == "GPT2BPETokenizer"
    assert config.optimizer.warmup_iters == 3200  # .01 x 320000 decay steps
    assert config.training.ckpt_optimizer_format == "fully_reshardable"
    # Megatron-LM's parser defaults where ours differ (tests/training/test_megatron_lm_parity.py)
    assert {k: m.extra[k] for k in ("attention_dropout", "hidden_dropout", "moe_aux_loss_coeff",
                                    "moe_router_dtype", "attention_softmax_in_fp32",
                                    "moe_token_dispatcher_type")} == {
        "attention_dropout": 0.1, "hidden_dropout": 0.1, "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": None, "attention_softmax_in_fp32": False,
        "moe_token_dispatcher_type": "allgather"}


def test_our_presets_keep_their_values():
    config = flags.config_from_args(["--model-preset", "tiny_smoe", "--hidden-size", "128"])
    from megatron_mvmoe.config.presets import PRESETS
    assert config.model.ffn_hidden_size == PRESETS["tiny_smoe"]["ffn_hidden_size"]
