"""GPT-3-style models as Megatron-LM builds them (issue 36 item 2): a Megatron-LM line without
--swiglu, --normalization, --position-embedding-type, --untie-embeddings-and-output-weights and
--disable-bias-linear builds GeLU MLPs and experts, LayerNorm, learned absolute positions, tied
embeddings and biased linear layers.

- The loss and every gradient of one step equal those of Megatron's stock GPTModel built as
  Megatron-LM's pretrain_gpt.py builds it from the same line (Megatron-LM's own parse_args /
  validate_args / core_transformer_config_from_args, its local MoE block spec), with the same
  weights (the stock model loads ours strictly: same parameters, same shapes).
- config/model_costs.py's parameter counts equal the built models' for each switch.
- The combinations whose math is not defined are refused in one line naming the field.
"""

import contextlib
import io
import math
import os
import sys

import pytest
import torch

from megatron_mvmoe.config import flags
from megatron_mvmoe.config.model_costs import parameter_counts
from megatron_mvmoe.config.model_section import model_section_from_dict
from megatron_mvmoe.testing.spawn import run_distributed

SEQ, MICRO = 16, 2
LINE = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
        f"--max-position-embeddings {SEQ} --num-experts 4 --moe-router-topk 2 "
        f"--micro-batch-size {MICRO} --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer "
        "--vocab-size 64 --mock-data --transformer-impl local --hidden-dropout 0 "
        "--attention-dropout 0 --moe-token-dispatcher-type alltoall "
        "--no-gradient-accumulation-fusion --no-bias-gelu-fusion").split()
"""A GPT-3-style smoe line (no architecture switch; dropout off so both runs are exact)."""


def test_gpt3_line_resolves_to_megatron_lm_architecture():
    m = flags.config_from_args(LINE).model
    assert (m.swiglu, m.normalization, m.position_embedding_type,
            m.untie_embeddings_and_output_weights, m.add_bias_linear) == \
        (False, "LayerNorm", "learned_absolute", False, True)
    assert m.ffn_hidden_size == m.moe_ffn_hidden_size == 4 * 32  # validate_args without --swiglu
    ours = flags.config_from_args(LINE + ["--swiglu", "--normalization", "RMSNorm",
                                          "--position-embedding-type", "rope",
                                          "--untie-embeddings-and-output-weights",
                                          "--disable-bias-linear"]).model
    assert (ours.swiglu, ours.normalization, ours.position_embedding_type,
            ours.untie_embeddings_and_output_weights, ours.add_bias_linear) == \
        (True, "RMSNorm", "rope", True, False)


CPU_ONLY = ["--use-cpu-initialization", "--no-persist-layer-norm"]
"""Added to Megatron-LM's line only: where its parameters live, and apex's persistent
LayerNorm kernel (absent on CPU); neither changes the math."""


def _megatron_lm_config(line):
    """Megatron-LM's TransformerConfig and args for `line`, as its pretrain_gpt.py makes them
    on one rank (tools/gen_megatron_lm_parity.py does the same for the recorded lines)."""
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 9  # it reads GPU 0; no field depends on it
    argv, sys.argv = sys.argv, ["pretrain_gpt.py", *line, *CPU_ONLY]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
            arguments.validate_args(args, {})
        return arguments.core_transformer_config_from_args(args), args
    finally:
        sys.argv = argv


def _stock_gpt(config, args, vocab_size, pgs):
    """pretrain_gpt.py's model_provider for an MoE line on the local backend."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    tied = not args.untie_embeddings_and_output_weights
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=tied,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    pg_collection=pgs)


def _ddp(model, config, pgs):
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp, module=model,
                                   pg_collection=pgs)


def _ours_and_stock(rank, world_size, line=LINE):
    from megatron_mvmoe.models.provider import build_model_chunks, transformer_config
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.platform import seed_all
    from megatron_mvmoe.testing.gpt_harness import global_batch, train_step_losses_and_grads

    os.environ.setdefault("WORLD_SIZE", "1")
    pgs = initialize_layout(ParallelLayout())
    model = flags.config_from_args(line).model
    seed_all(0)
    ours_config = transformer_config(model)
    ours = build_model_chunks(ours_config, model, pgs)[0]
    stock_config, args = _megatron_lm_config(line)
    seed_all(1)
    stock = _stock_gpt(stock_config, args, model.vocab_size, pgs)
    stock.load_state_dict(ours.state_dict(), strict=True)  # same parameters and shapes
    tokens = global_batch(2 * MICRO, SEQ, model.vocab_size)
    return {name: train_step_losses_and_grads(_ddp(net, config, pgs), config, tokens, MICRO,
                                              pgs)
            for name, net, config in (("ours", ours, ours_config),
                                      ("stock", stock, stock_config))}


def test_gpt3_line_trains_as_megatron_lm_stock_gpt_model():
    _assert_same_step(run_distributed(_ours_and_stock, 1, timeout_s=240)[0])


GPT_OSS_MLP = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
               "0.05"]
"""GPT-OSS's clamped quick-GeGLU (its corpus line clamps at 7.0; 0.05 here so the clamp acts
on this tiny model's fc1 outputs, std ~0.1)."""


def test_gpt_oss_quick_geglu_trains_as_megatron_lm_stock_gpt_model():
    """--quick-geglu / --glu-linear-offset / --activation-func-clamp-value build Megatron-LM's
    TransformerConfig (argument_utils: gated quick_gelu), and our experts (the grouped CPU
    path) compute what its stock SequentialMLP computes."""
    line = LINE + GPT_OSS_MLP
    assert flags.config_from_args(line).model.quick_geglu
    _assert_same_step(run_distributed(_ours_and_stock, 1, timeout_s=240, args=(line,))[0])


GPT_OSS_ATTENTION = ["--window-size", "3,0", "--window-attn-skip-freq", "2", "--softmax-type",
                     "learnable"]
"""GPT-OSS's attention but YaRN: a sliding window (3 tokens back here, 127 in its line) in
every other layer, learnable softmax sinks."""


def test_gpt_oss_window_and_sinks_train_as_megatron_lm_stock_gpt_model():
    """--window-size / --window-attn-skip-freq / --softmax-type reach Megatron's
    TransformerConfig as Megatron-LM's parser reads them; SDPA cannot serve them, so
    Megatron's DotProductAttention does (a learnable sink per head: one more parameter)."""
    line = LINE + GPT_OSS_ATTENTION
    assert flags.config_from_args(line).model.extra["window_size"] == [3, 0]
    _assert_same_step(run_distributed(_ours_and_stock, 1, timeout_s=240, args=(line,))[0])


YARN = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9",
        "--mscale-all-dim", "0.5", "--yarn-original-max-position-embeddings", "4",
        "--yarn-beta-fast", "8", "--yarn-beta-slow", "2",
        "--no-yarn-correction-range-round-to-int"]
"""YaRN of standard attention with every parameter off its default (an original context of
4 < the 16-token sequence, so the correction acts); the factor and the mscales are MLA's
flags, which Megatron-LM's argument_utils maps to config.yarn_* on a model without MLA."""


def test_yarn_of_standard_attention_trains_as_megatron_lm_stock_gpt_model():
    from megatron_mvmoe.models.build import model_config

    config = model_config(flags.config_from_args(LINE + YARN))
    assert (config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim,
            config.yarn_original_max_position_embeddings, config.yarn_beta_fast,
            config.yarn_beta_slow, config.yarn_correction_range_round_to_int) == (
        4.0, 0.9, 0.5, 4, 8.0, 2.0, False)
    _assert_same_step(run_distributed(_ours_and_stock, 1, timeout_s=240,
                                      args=(LINE + YARN,))[0])


def test_yarn_fields_are_refused_where_nothing_reads_them():
    from megatron_mvmoe.models.build import model_config

    with pytest.raises(ValueError, match=r"model.extra.yarn_beta_fast: .* act only with YaRN"):
        model_config(flags.config_from_args(LINE + ["--yarn-beta-fast", "8"]))
    with pytest.raises(ValueError, match=r"position_embedding_type: yarn with multi-latent"):
        model_config(flags.config_from_args(LINE + YARN + ["--multi-latent-attention"]))


def test_checkpoints_record_yarn_and_older_ones_still_load():
    """A YaRN model's fingerprint (run_state.json) records its yarn_* fields: another scaling
    factor is another model; a checkpoint from before YaRN (no yarn_* in extra) resumes a
    RoPE run as before."""
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint, model_fingerprint

    yarn = flags.config_from_args(LINE + YARN).model
    saved = model_fingerprint(yarn)
    assert saved["position_embedding_type"] == "yarn"
    assert saved["extra"]["yarn_rotary_scaling_factor"] == 4.0
    other = flags.config_from_args(LINE + YARN[:-1] + ["--rotary-scaling-factor", "2"]).model
    with pytest.raises(CheckpointError, match="yarn_rotary_scaling_factor"):
        check_fingerprint(saved, model_fingerprint(other), "ckpt")
    rope = _model("tiny_smoe", {})
    before_yarn = {k: v for k, v in model_fingerprint(rope).items()}
    assert not any(k.startswith("yarn") for k in before_yarn["extra"])
    check_fingerprint(before_yarn, model_fingerprint(rope), "ckpt")


def test_clamp_and_offset_without_a_gated_unit_are_refused():
    from megatron_mvmoe.models.build import model_config

    with pytest.raises(ValueError, match=r"glu_linear_offset: acts only on a gated MLP.*"
                                         r"--quick-geglu"):
        model_config(flags.config_from_args(LINE + ["--glu-linear-offset", "1.0"]))
    with pytest.raises(ValueError, match="quick_geglu: cannot be combined with swiglu"):
        model_config(flags.config_from_args(LINE + ["--quick-geglu", "--swiglu"]))


def _assert_same_step(out):
    ours, stock = out["ours"], out["stock"]
    assert ours["loss"] == pytest.approx(stock["loss"], abs=1e-6)
    assert set(ours["grads"]) == set(stock["grads"])
    assert any(name.endswith("bias") for name in ours["grads"])  # biases trained
    for name, (grad, *_) in stock["grads"].items():
        torch.testing.assert_close(ours["grads"][name][0], grad, atol=1e-6, rtol=1e-5,
                                   msg=name)


GPT3 = dict(swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
            untie_embeddings_and_output_weights=False)
"""Every GPT-3 switch but the biases, which only the stock layers take."""
COUNTED = {
    "smoe, all GPT-3 switches and biases": ("tiny_smoe", dict(GPT3, add_bias_linear=True)),
    "dense with biases, QK LayerNorm": ("tiny_dense", dict(GPT3, add_bias_linear=True,
                                                          extra={"qk_layernorm": True})),
    "seed-2 smoe/dense alternation": ("seed2_tiny_smoe", dict(GPT3, add_bias_linear=True)),
    "latent": ("tiny_latent", GPT3),
    "multi_view": ("tiny_multi_view", GPT3),
    "mh_moe": ("tiny_mh_moe", GPT3),
    "a learned table of --max-position-embeddings rows": (
        "tiny_smoe", dict(GPT3, max_position_embeddings=96)),
    "MLA with LayerNorm": ("tiny_smoe", dict(GPT3, extra={
        "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 8, "qk_layernorm": True})),
}
"""Built model -> (preset, model overrides): every variant with the GPT-3 switches."""


def _model(preset, overrides):
    from megatron_mvmoe.config.model_section import model_from_preset

    return model_from_preset(preset, **overrides)


def _built_counts(rank, world_size):
    from megatron_mvmoe.models.provider import (build_model_chunks, count_parameters,
                                                transformer_config)
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    pgs = initialize_layout(ParallelLayout())
    out = {}
    for name, (preset, overrides) in COUNTED.items():
        model = _model(preset, overrides)
        out[name] = count_parameters(build_model_chunks(transformer_config(model), model, pgs))
    return out


def test_parameter_counts_follow_the_architecture_fields():
    built = run_distributed(_built_counts, 1, timeout_s=240)[0]
    for name, (preset, overrides) in COUNTED.items():
        assert parameter_counts(_model(preset, overrides))["total"] == built[name], name


REFUSED = {
    "latent": ("tiny_latent", {}, "variant latent's own projections"),
    "multi_view": ("tiny_multi_view", {}, "variant multi_view's own projections"),
    "mh_moe": ("tiny_mh_moe", {}, "variant mh_moe's own projections"),
    "BitNet": ("tiny_smoe", {"bitnet": {"enabled": True}}, "BitLinear has no bias"),
    "shared expert": ("tiny_smoe", {"moe_shared_expert_intermediate_size": 32},
                      "shared expert has no biases"),
    "MLA": ("tiny_smoe", {"extra": {"multi_latent_attention": True}}, "MLA's biases"),
}
"""Biased linears where the math is not defined here (preset, overrides, reason)."""


@pytest.mark.parametrize("name", REFUSED)
def test_biases_refused_where_undefined(name):
    from megatron_mvmoe.models.provider import transformer_config

    preset, overrides, reason = REFUSED[name]
    with pytest.raises(ValueError) as err:
        transformer_config(_model(preset, dict(overrides, add_bias_linear=True)))
    message = str(err.value)
    assert message.startswith("add_bias_linear: ") and reason in message, message
    assert "--disable-bias-linear" in message and "\n" not in message


def test_tied_embeddings_at_pp2_train_as_at_pp1(text_tokens, tmp_path):
    """Tied embeddings at PP 2 on CPU (refused until platform/cpu_embedding_copy.py: Megatron
    moved the last stage's copy of the word embedding with .cuda()). A fresh PP 2 run starts
    with the copy equal to the embedding (left zero, every logit would be 0 and the first loss
    exactly ln 512), and PP 1 resumed from its step-1 checkpoint has its losses: the two
    stages' embedding gradients are summed."""
    from harness import tiny_run, train

    def run(pp, **training):
        raw = tiny_run(text_tokens, preset="tiny_smoe", parallel={"pp": pp}, eval_iters=0,
                       ckpt_optimizer_format="fully_reshardable", **training)
        raw["model"].update(GPT3)
        return train(raw, pp)

    two = run(2, train_iters=4, save=str(tmp_path / "ck"), save_interval=1)["losses"]
    assert abs(two[0] - math.log(512)) > 1e-3, two
    (tmp_path / "ck" / "latest").write_text("iter_0000001\n")
    one = run(1, train_iters=4, load=str(tmp_path / "ck"))["losses"]
    assert len(one) == 3 and max(abs(a - b) for a, b in zip(one, two[1:])) < 1e-5, (one, two)


def test_megatron_lm_line_with_latent_variant_is_refused_in_one_line():
    from megatron_mvmoe.models.build import validate_run  # the trainer's start-up check

    run = flags.config_from_args(LINE + ["--moe-variant", "latent", "--latent-size", "16"])
    with pytest.raises(ValueError, match=r"^model.add_bias_linear: .*--disable-bias-linear"):
        validate_run(run)


def test_export_and_upcycling_refuse_what_they_do_not_map():
    from megatron_mvmoe.hf.config_map import unsupported_architecture
    from megatron_mvmoe.models.upcycling import upcycle_problems

    with pytest.raises(ValueError, match="^model.untie_embeddings_and_output_weights: "):
        unsupported_architecture(_model("tiny_smoe", GPT3))
    with pytest.raises(ValueError, match="^model.position_embedding_type: "):
        unsupported_architecture(_model("tiny_smoe", dict(
            GPT3, untie_embeddings_and_output_weights=True)))
    with pytest.raises(ValueError, match="^model.position_embedding_type: 'yarn'"):
        unsupported_architecture(_model("tiny_smoe", {"position_embedding_type": "yarn"}))
    unsupported_architecture(_model("tiny_smoe", {}))  # ours exports
    dense = _model("tiny_dense", {"add_bias_linear": True})
    problems = upcycle_problems(dense, _model("tiny_smoe", {"add_bias_linear": True}))
    assert [p.split(":")[0] for p in problems] == ["add_bias_linear"], problems


def test_resume_refuses_another_architecture_and_reads_older_checkpoints():
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint, model_fingerprint
    from megatron_mvmoe.config.model_section import ARCHITECTURE_FIELDS

    ours, gpt3 = _model("tiny_smoe", {}), _model("tiny_smoe", dict(GPT3, add_bias_linear=True))
    with pytest.raises(CheckpointError) as err:
        check_fingerprint(model_fingerprint(gpt3), model_fingerprint(ours), "ckpt")
    differ = [name for name in ARCHITECTURE_FIELDS if name != "quick_geglu"]
    assert all(f"{name}: checkpoint" in str(err.value) for name in differ)
    quick = _model("tiny_smoe", dict(GPT3, quick_geglu=True))
    with pytest.raises(CheckpointError, match="quick_geglu: checkpoint True vs this run False"):
        check_fingerprint(model_fingerprint(quick), model_fingerprint(gpt3), "ckpt")
    before_issue_36 = {k: v for k, v in model_fingerprint(ours).items()
                       if k not in ARCHITECTURE_FIELDS}
    check_fingerprint(before_issue_36, model_fingerprint(ours), "ckpt")  # ours, as always


def test_a_learned_table_of_other_rows_is_another_model_a_rope_one_is_not():
    """--max-position-embeddings sizes a learned table (Megatron-LM's GPTModel gets it as
    max_sequence_length): a checkpoint with other rows is refused by name; one with the
    sequence length's rows (every learned table before the flag was mapped) or RoPE loads."""
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint, model_fingerprint

    def fingerprint(**fields):
        return model_fingerprint(_model("tiny_smoe", fields))

    seq = _model("tiny_smoe", {}).seq_length
    with pytest.raises(CheckpointError, match=r"position_table_rows: checkpoint None vs this "
                                              r"run 96"):
        check_fingerprint(fingerprint(**GPT3), fingerprint(**GPT3, max_position_embeddings=96),
                          "ckpt")
    check_fingerprint(fingerprint(**GPT3), fingerprint(**GPT3, max_position_embeddings=seq),
                      "ckpt")
    check_fingerprint(fingerprint(), fingerprint(max_position_embeddings=4 * seq), "ckpt")


def test_trainer_saves_and_resumes_a_gpt3_model_exactly(tmp_path, text_tokens):
    """The trainer's own path (data, DDP, optimizer, dist checkpoint of tied embeddings, biases,
    LayerNorm and the position table): a resume from step 2 repeats steps 3-4 bit for bit."""
    from harness import tiny_run, train

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=4, save_interval=2,
                   save=str(tmp_path / "ck"))
    raw["model"].update(GPT3, add_bias_linear=True)
    full = train(raw, 1)["losses"]
    raw["training"].update(load=str(tmp_path / "ck"), ckpt_step=2, save=str(tmp_path / "ck2"))
    assert train(raw, 1)["losses"] == full[2:]
