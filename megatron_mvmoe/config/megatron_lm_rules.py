"""Megatron-LM launch-line rules that turn a flag into other run-config fields, as
Megatron-LM does:

- samples-based schedules (`--train-samples`, `--lr-decay-samples`, `--lr-warmup-samples`)
  become step counts: Megatron-LM's scheduler counts samples and advances by the global
  batch per step, so N samples are N / global_batch_size steps exactly when that divides;
  otherwise the step count would not be exact and the flag is refused with the nearest
  exact values;
- `--lr-warmup-fraction` is that fraction of the decay length (Megatron-LM's
  `lr_warmup_fraction * lr_decay_steps`): a whole number of steps is warmup_iters, any
  other is kept as optimizer.warmup_fraction and the warmup ends mid-step, as it does in
  Megatron-LM's sample-counting scheduler;
- `--distributed-timeout-minutes` is the collective timeout in minutes.
- `--num-virtual-stages-per-pipeline-rank N` is the virtual-pipeline size N (Megatron-LM's
  validate_args; N = 1 means no interleaving).
- `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim` on a YaRN model without MLA
  are its yarn_* fields (config/yarn.py), as Megatron-LM's argument_utils maps them.
- `--moe-use-upcycling --load D --save S` upcycles the dense checkpoint D: it becomes
  --warm-start-from D --load S (a relaunch resumes S).

- a Megatron-LM style line (no --config, no --model-preset) gets Megatron-LM's defaults
  where a flag is absent, its GPT-3 architecture included: without --swiglu GeLU MLPs,
  without --normalization LayerNorm, without --position-embedding-type learned positions,
  without --untie-embeddings-and-output-weights tied embeddings, without
  --disable-bias-linear biased linear layers (model fields; models/provider.py builds them
  as Megatron-Core does), without --moe-permute-fusion / --moe-router-fusion those kernels
  unfused. The FFN width defaults as in Megatron-LM (`validate_args`: 4h,
  or 2/3 of it with --swiglu), and --vocab-file/--merge-file without --tokenizer-type is
  GPT2BPETokenizer, whose vocabulary (padded) is the model's. Every other run-config field
  behind a Megatron-LM flag takes Megatron-LM's parser default (config/megatron_lm_defaults.py:
  optimizer, schedule, precision, timeout, evaluation, logging). Our own YAML presets keep
  their values.

Each rule returns its problems as lines so a launch line's refusals come in one pass.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

from megatron_mvmoe.config import megatron_lm_defaults
from megatron_mvmoe.config.run_config import TrainingSection
from megatron_mvmoe.config.yarn import respell_mla_flags

CONVERTED = {
    "--train-samples": (int, "training samples; steps = samples / --global-batch-size"),
    "--lr-decay-samples": (int, "decay length in samples (/ --global-batch-size = steps)"),
    "--lr-warmup-samples": (int, "warmup in samples (/ --global-batch-size = steps)"),
    "--lr-warmup-fraction": (float, "warmup as a fraction of the decay length"),
    "--distributed-timeout-minutes": (float, "collective timeout in minutes"),
    "--num-virtual-stages-per-pipeline-rank": (
        int, "virtual pipeline stages per pipeline rank (= --virtual-pipeline-model-"
             "parallel-size; 1 = no interleaving)"),
}
_IN_STEPS = {"--train-samples": ("training", "train_iters", "--train-iters"),
             "--lr-decay-samples": ("optimizer", "decay_iters", "--lr-decay-iters"),
             "--lr-warmup-samples": ("optimizer", "warmup_iters", "--lr-warmup-iters")}


def _dest(name: str) -> str:
    return "conv_" + name.lstrip("-").replace("-", "_")


def add_converted_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM flags converted to our fields")
    for name, (kind, text) in CONVERTED.items():
        group.add_argument(name, dest=_dest(name), type=kind, default=None, metavar="N",
                           help=text)


def given(args: argparse.Namespace, name: str) -> Optional[Any]:
    return getattr(args, _dest(name), None)


def _section(raw: Dict[str, Any], name: str) -> Dict[str, Any]:
    if not isinstance(raw.get(name), dict):
        raw[name] = {}
    return raw[name]


def apply_conversions(raw: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """Set the step / timeout fields from the samples / minutes flags (in place); returns
    refusal lines."""
    problems: List[str] = []
    training, optimizer = _section(raw, "training"), _section(raw, "optimizer")
    gbs = int(training.get("global_batch_size", TrainingSection.global_batch_size))
    sections = {"training": training, "optimizer": optimizer}
    for name, (section, field, iters_flag) in _IN_STEPS.items():
        samples = given(args, name)
        if samples is None:
            continue
        if getattr(args, iters_flag.lstrip("-").replace("-", "_"), None) is not None:
            problems.append(f"{name}: not supported together with {iters_flag} (Megatron-LM "
                            f"refuses both too). Use instead: one of them")
        elif samples % gbs:
            low, high = samples // gbs * gbs, (samples // gbs + 1) * gbs
            problems.append(f"{name} {samples}: not supported: not a multiple of "
                            f"--global-batch-size {gbs}, so the step count would not be "
                            f"exact. Use instead: {name} {low} or {high}")
        else:
            sections[section][field] = samples // gbs
    fraction = given(args, "--lr-warmup-fraction")
    if fraction is not None:
        problems += _warmup_fraction(fraction, training, optimizer, args)
    minutes = given(args, "--distributed-timeout-minutes")
    if minutes is not None:
        _section(raw, "parallel")["distributed_timeout_seconds"] = 60.0 * minutes
    problems += _virtual_stages(raw, args)
    _upcycling_source(training)
    respell_mla_flags(_section(raw, "model"))  # --rotary-scaling-factor on a YaRN model
    return problems


def _virtual_stages(raw: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """Megatron-LM's validate_args: virtual_pipeline_model_parallel_size =
    num_virtual_stages_per_pipeline_rank, and 1 stage means none (no interleaving)."""
    stages = given(args, "--num-virtual-stages-per-pipeline-rank")
    if stages is None:
        return []
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        return ["--num-virtual-stages-per-pipeline-rank: not supported together with "
                "--pipeline-model-parallel-layout (Megatron-LM refuses both: the layout's "
                "stages set the virtual-pipeline size). Use instead: one of them"]
    if args.virtual_pipeline_model_parallel_size is not None:
        return ["--num-virtual-stages-per-pipeline-rank: not supported together with "
                "--virtual-pipeline-model-parallel-size (both set the virtual-pipeline "
                "size). Use instead: one of them"]
    _section(raw, "parallel")["vpp"] = stages if stages > 1 else None
    return []


def _upcycling_source(training: Dict[str, Any]) -> None:
    """Megatron-LM's --moe-use-upcycling reads the dense checkpoint from --load and writes
    the MoE run to --save: here that is --warm-start-from <load> with --load <save>, so the
    same line upcycles on the first launch and resumes the MoE run on a relaunch."""
    if training.get("moe_use_upcycling") and training.get("warm_start_from") is None \
            and training.get("load") is not None:
        training["warm_start_from"] = training["load"]
        training["load"] = training.get("save")


def _warmup_fraction(fraction: float, training: Dict, optimizer: Dict,
                     args: argparse.Namespace) -> List[str]:
    if args.lr_warmup_iters is not None or given(args, "--lr-warmup-samples") is not None:
        return ["--lr-warmup-fraction: not supported together with --lr-warmup-iters / "
                "--lr-warmup-samples (Megatron-LM refuses both too). Use instead: one of them"]
    decay = optimizer.get("decay_iters") or training.get(
        "train_iters", TrainingSection.train_iters)
    steps = fraction * decay
    if abs(steps - round(steps)) > 1e-9:
        optimizer["warmup_fraction"] = fraction  # ends mid-step, as in Megatron-LM
    else:
        optimizer["warmup_iters"] = int(round(steps))
    return []



# Megatron-LM's GPT-3 architecture on a line without the switch: (args dest, model field,
# Megatron-LM's value). Value flags (--normalization, --position-embedding-type) take the
# parser's default like every other flag (megatron_lm_defaults.parser_defaults).
_ARCHITECTURE = (
    ("swiglu", "swiglu", False),
    ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights", False),
    ("disable_bias_linear", "add_bias_linear", True),
)
# Megatron-LM's fusions that a switch turns on (its parser's default: unfused); on our presets
# the platform decides (models/fast_paths.py).
_OPT_IN_FUSIONS = (
    ("moe_permute_fusion", "moe_permute_fusion", False),
    ("moe_router_fusion", "moe_router_fusion", False),
)


# Fields whose default here suits our presets but differs from Megatron-LM's parser default
# (megatron_lm_flags.json); on a Megatron-LM style line the parser's default applies.
# tests/training/test_megatron_lm_parity.py found each one against Megatron-LM's own parser.
_PARSER_DEFAULTS = (("--attention-dropout", "attention_dropout"),
                    ("--hidden-dropout", "hidden_dropout"),
                    ("--moe-aux-loss-coeff", "moe_aux_loss_coeff"),
                    ("--moe-router-dtype", "moe_router_dtype"),
                    ("--attention-softmax-in-fp32", "attention_softmax_in_fp32"))


def megatron_lm_style(args: argparse.Namespace) -> bool:
    """A launch line without our YAML or preset: Megatron-LM's defaults apply."""
    return not args.config and not args.model_preset


def apply_megatron_lm_defaults(raw: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """Megatron-LM's defaults for absent flags on a Megatron-LM style line (in place);
    returns refusal lines for the defaults this trainer cannot take on this platform."""
    if not megatron_lm_style(args):
        return []
    model = _section(raw, "model")
    for dest, name, value in _ARCHITECTURE + _OPT_IN_FUSIONS:
        if getattr(args, dest) is None:
            model.setdefault(name, value)
    problems = _parser_defaults(model, raw)
    megatron_lm_defaults.apply(raw, args)
    hidden = model.get("hidden_size")
    if model.get("ffn_hidden_size") is None and hidden is not None:
        # Megatron-LM validate_args: 4h, with --swiglu 2/3 of it rounded down to 64.
        model["ffn_hidden_size"] = int((4 * hidden * 2 / 3) / 64) * 64 if model["swiglu"] \
            else 4 * hidden
    if model.get("num_experts") and model.get("moe_ffn_hidden_size") is None:
        model["moe_ffn_hidden_size"] = model.get("ffn_hidden_size")
    data = _section(raw, "data")
    if data.get("tokenizer_type") is None and data.get("vocab_file") and \
            data.get("merge_file"):
        data["tokenizer_type"] = "GPT2BPETokenizer"
    return problems


def _parser_defaults(model: Dict[str, Any], raw: Dict[str, Any]) -> List[str]:
    """Megatron-LM's parser defaults for absent flags (see _PARSER_DEFAULTS), its
    dispatcher default for its own MoE (our latent variants need alltoall), and its
    expert-tensor-parallel default (= --tensor-model-parallel-size)."""
    from megatron_mvmoe.config.megatron_lm_table import table

    extra = model.setdefault("extra", {})
    for flag, name in _PARSER_DEFAULTS:
        extra.setdefault(name, table()[flag].default)
    if model.get("moe_variant") in (None, "smoe"):
        extra.setdefault("moe_token_dispatcher_type",
                         table()["--moe-token-dispatcher-type"].default)
    parallel = _section(raw, "parallel")
    tp = parallel.get("tp") or 1
    if parallel.get("etp") is None and tp > 1 and model.get("num_experts"):
        parallel["etp"] = tp  # gloo's uneven all-gather: platform/cpu_uneven_gather.py
    return []


def backend_problems(raw: Dict[str, Any]) -> List[str]:
    """Dispatcher/backend choices that would fail inside the model build, refused first:
    Megatron's flex dispatcher imports DeepEP or HybridEP when the MoE layer is built."""
    import importlib.util
    extra = (raw.get("model") or {}).get("extra") or {}
    if extra.get("moe_token_dispatcher_type") != "flex":
        return []
    if any(importlib.util.find_spec(m) for m in ("deep_ep", "hybrid_ep")):
        return []
    return [
        "--moe-token-dispatcher-type flex: not supported: it needs DeepEP or HybridEP (pip "
        "install deep_ep, on GPUs with NVSHMEM), and neither is installed. Use instead: "
        "--moe-token-dispatcher-type alltoall"]
