"""Record what Megatron-LM's own argument parser builds from a Megatron-LM MoE launch line, so
the suite can compare this trainer's model config with it field by field
(tests/training/test_megatron_lm_parity.py; `megatron_lm_record` live for every resolving
corpus line: tests/training/test_megatron_lm_corpus_parity.py).

The lines: Megatron-LM's GPT-3 MoE functional test
`tests/functional_tests/test_cases/moe/gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel/
model_config.yaml` at NVIDIA/Megatron-LM core_r0.19.0 (f8837c04ef6cbef6cdefb8de001aad63178aebbf),
its MODEL_ARGS in order as written (`key: true` a bare switch, `${...}` paths replaced by
placeholders; GPT-3: GeLU, LayerNorm, learned positions, tied embeddings, which this trainer
builds: tests/training/test_gpt3_architecture.py); a bare MoE line giving only what Megatron-LM
requires (BARE_LINE, tests/training/test_megatron_lm_defaults_parity.py); and the bare line with
--bf16 (what validate_args derives from bf16).

What runs: Megatron-LM's `megatron/training/arguments.py` (the copy shipped in the pinned
megatron-core 0.19.2 wheel; with --mirror it is first checked byte for byte against the
mirror's file at f8837c04): `parse_args`, `validate_args` and
`core_transformer_config_from_args`, on this CPU machine, as a launch with WORLD_SIZE = 8
(TP 2 x PP 2 x DP 2) and the test's CUDA_DEVICE_MAX_CONNECTIONS=1 would run them; then
Megatron-LM's `get_optimizer_param_scheduler` on a torch Adam for the schedule. Three
stand-ins for the GPU machine the test runs on, none of which sets a field:
`get_device_arch_version()` and `torch.cuda.get_device_capability()` (they read GPU 0) say
Hopper (9, 0): validate_args uses them only to decide whether CUDA_DEVICE_MAX_CONNECTIONS
must be 1, which streams get priority, and (--moe-grouped-gemm) that the GPU has grouped
GEMM kernels; and TransformerEngine's fused RoPE and fused permutation count as installed:
a line keeps Megatron-LM's default apply_rope_fusion=True (or asks for
--moe-permute-fusion), and TransformerConfig.__post_init__ only checks that the kernels
exist (they are never called here). CUDA_DEVICE_MAX_CONNECTIONS is 1, as the functional
tests' ENV_VARS set it, except on a --use-megatron-fsdp line, whose test sets none
(validate_args refuses 1 with Megatron-FSDP).

Output: tests/assets/megatron_lm_parity/<test case>.json with the line, the source, every
TransformerConfig field (JSON-able, activation by name), the model arguments outside
TransformerConfig (position embedding, tying, vocabulary padding) and the scheduler's fields.

Usage: .venv/bin/python tools/gen_megatron_lm_parity.py [--mirror DIR] [--check] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMIT = "f8837c04ef6cbef6cdefb8de001aad63178aebbf"
CASE = "gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel"
CASE_PATH = f"tests/functional_tests/test_cases/moe/{CASE}/model_config.yaml"
ASSETS = os.path.join(ROOT, "tests", "assets", "megatron_lm_parity")
OUT = os.path.join(ASSETS, f"{CASE}.json")
BARE = "bare_moe_line"
BARE_LINE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10 --lr 1e-4 "
             "--num-experts 4 --expert-model-parallel-size 2 --mock-data --tokenizer-type "
             "NullTokenizer --vocab-size 512").split()
"""A bare Megatron-LM MoE line: only what Megatron-LM requires (shape, batch, steps, lr) and
the data, so that every other field is the parser's default (issue 36: the defaults-parity
test, tests/training/test_megatron_lm_defaults_parity.py). Recorded at WORLD_SIZE = 8:
EP 2, DP 8."""
BARE_OUT = os.path.join(ASSETS, f"{BARE}.json")
BARE_BF16_OUT = os.path.join(ASSETS, f"{BARE}_bf16.json")
"""The bare line with --bf16: what Megatron-LM's validate_args derives from bf16 (gradients
accumulated and reduced in fp32, ...) is compared too."""
EXPLICIT = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights"]
PLACEHOLDERS = {"${TENSORBOARD_PATH}": "TB", "${CHECKPOINT_SAVE_PATH}": "CK",
                "${CHECKPOINT_LOAD_PATH}": "CK", "${DATA_PATH}": "DATA",
                "${DATA_CACHE_PATH}": "CACHE"}
MODEL_ARGS = ("position_embedding_type", "rotary_base", "rotary_percent",
              "untie_embeddings_and_output_weights", "max_position_embeddings", "seq_length",
              "make_vocab_size_divisible_by", "tokenizer_type", "micro_batch_size",
              "global_batch_size", "train_iters", "data_parallel_size")
TRAINING_ARGS = ("eval_interval", "eval_iters", "log_interval", "save_interval",
                 "distributed_timeout_minutes", "bf16", "fp16", "seed", "split",
                 "check_for_nan_in_loss_and_grad", "exit_on_missing_checkpoint",
                 "moe_router_topk", "num_query_groups", "group_query_attention")
"""Launch fields outside the Megatron configs whose defaults the run config must follow."""
SCHEDULER = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps",
             "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps")


def line_from_config(text: str) -> list:
    """MODEL_ARGS of a functional-test model_config.yaml as a command line."""
    import yaml

    line = []
    for flag, value in yaml.safe_load(text)["MODEL_ARGS"].items():
        if value is True:
            line.append(flag)
        elif value is not False:
            for placeholder, short in PLACEHOLDERS.items():
                value = str(value).replace(placeholder, short)
            line += [flag, str(value)]
    return line


def _git_show(mirror: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", mirror, "show", f"{COMMIT}:{path}"],
                          check=True, capture_output=True, text=True).stdout


def check_installed_copy(mirror: str) -> None:
    """The wheel's arguments.py is the mirror's at COMMIT (else the record is not of it)."""
    import megatron.training.arguments as arguments

    if open(arguments.__file__).read() != _git_show(mirror, "megatron/training/arguments.py"):
        raise SystemExit(f"error: {arguments.__file__} differs from Megatron-LM {COMMIT[:8]}'s "
                         "megatron/training/arguments.py. Fix: regenerate against the "
                         "installed release and update COMMIT")


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.name
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    try:
        json.dumps(value)
        return value
    except TypeError:  # e.g. functools.partial(<function normal_ at 0x..>, std=0.02)
        return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def _te_kernel_is_installed(*args, **kwargs):
    raise AssertionError("only its presence is checked (TransformerConfig.__post_init__)")


TE_KERNELS = (("megatron.core.models.common.embeddings.rope_utils",
               "fused_apply_rotary_pos_emb"),
              *(("megatron.core.transformer.moe.moe_utils", name) for name in (
                  "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                  "fused_sort_chunks_by_index_with_probs", "fused_unpermute")))
"""TransformerEngine's kernels whose presence TransformerConfig checks (stand-in 2)."""


@contextlib.contextmanager
def _te_kernels_installed():
    """Stand-in 2 (module docstring): each missing TE kernel of TE_KERNELS present."""
    import importlib

    modules = [(importlib.import_module(module), name) for module, name in TE_KERNELS]
    saved = [getattr(module, name) for module, name in modules]
    try:
        for module, name in modules:
            if getattr(module, name) is None:
                setattr(module, name, _te_kernel_is_installed)
        yield
    finally:
        for (module, name), value in zip(modules, saved):
            setattr(module, name, value)


def megatron_lm_args(line: list):
    """Megatron-LM's parse_args -> validate_args for `line` at WORLD_SIZE 8 (module docstring;
    sets WORLD_SIZE, RANK, LOCAL_RANK, CUDA_DEVICE_MAX_CONNECTIONS in os.environ)."""
    from megatron.training import arguments

    import torch

    os.environ.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0",
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    if "--use-megatron-fsdp" in line:
        del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]  # its test sets none (docstring)
    arguments.get_device_arch_version = lambda: 9  # stand-in 1 (module docstring)
    argv, sys.argv = sys.argv, ["pretrain_gpt.py", *line]
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # stand-in 1 too
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its listing of every argument
            args = arguments.parse_args()
            arguments.validate_args(args, {})
    finally:
        sys.argv, torch.cuda.get_device_capability = argv, capability
    return args


def megatron_lm_scheduler(args):
    """Megatron-LM's get_optimizer_param_scheduler for parsed `args`, on a torch Adam (it
    reads the global args, which this sets)."""
    import torch
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler

    global_vars.set_args(args)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    return get_optimizer_param_scheduler(adam)


def megatron_lm_record(line: list) -> dict:
    """Megatron-LM's parse_args -> validate_args -> core_transformer_config_from_args and
    scheduler for `line` (see the module docstring)."""
    from megatron.training import arguments
    from megatron.training.training import (get_megatron_ddp_config,
                                            get_megatron_optimizer_config)

    args = megatron_lm_args(line)
    with _te_kernels_installed():  # as on the test's GPUs
        config = arguments.core_transformer_config_from_args(args)
    scheduler = megatron_lm_scheduler(args)
    return {"transformer_config": {f.name: _jsonable(getattr(config, f.name))
                                   for f in dataclasses.fields(config)},
            "model_args": {name: _jsonable(getattr(args, name)) for name in MODEL_ARGS},
            "scheduler": {name: _jsonable(getattr(scheduler, name)) for name in SCHEDULER},
            "optimizer_config": _fields(get_megatron_optimizer_config(args)[0]),
            "ddp_config": _fields(get_megatron_ddp_config(args)),
            "training_args": {name: _jsonable(getattr(args, name, None))
                              for name in TRAINING_ARGS}}


def _fields(config) -> dict:
    return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}


PARSER = ("megatron/training/arguments.py of megatron-core 0.19.2 (= the file at "
          f"{COMMIT[:8]}): parse_args, validate_args, core_transformer_config_from_args; "
          "training.get_optimizer_param_scheduler, get_megatron_optimizer_config, "
          "get_megatron_ddp_config")


def build_record(mirror: str) -> dict:
    config_text = _git_show(mirror, CASE_PATH)
    line = line_from_config(config_text)
    return {"source": f"NVIDIA/Megatron-LM {COMMIT} {CASE_PATH} MODEL_ARGS",
            "parser": PARSER, "world_size": 8, "line": line, **megatron_lm_record(line)}


def build_bare_record(extra=()) -> dict:
    line = list(BARE_LINE) + list(extra)
    return {"source": "tools/gen_megatron_lm_parity.py BARE_LINE" + "".join(
                f" {flag}" for flag in extra),
            "parser": PARSER, "world_size": 8, "line": line, **megatron_lm_record(line)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mirror", default="/work/.mirror/NVIDIA+Megatron-LM/repo",
                        help="git directory of a NVIDIA/Megatron-LM clone holding " + COMMIT[:8])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed record differs from a fresh one")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.mirror):
        print(f"error: --mirror {args.mirror}: not a directory. Fix: fetch NVIDIA/Megatron-LM "
              "and pass its git directory", file=sys.stderr)
        return 2
    import megatron_mvmoe  # noqa: F401  (its log filters: the record's run prints no noise)

    check_installed_copy(args.mirror)
    records = {OUT: build_record(args.mirror), BARE_OUT: build_bare_record(),
               BARE_BF16_OUT: build_bare_record(["--bf16"])}
    texts = {out: json.dumps(record, indent=1) + "\n" for out, record in records.items()}
    if args.check:
        same = all(os.path.isfile(out) and open(out).read() == text
                   for out, text in texts.items())
        print(json.dumps({"same": same}) if args.json else
              ("records up to date" if same else "records differ: rerun without --check"))
        return 0 if same else 1
    os.makedirs(ASSETS, exist_ok=True)
    summary = []
    for out, text in texts.items():
        with open(out, "w") as fh:
            fh.write(text)
        record = records[out]
        summary.append({"out": os.path.relpath(out, ROOT),
                        "fields": {part: len(record[part]) for part in
                                   ("transformer_config", "optimizer_config", "ddp_config")},
                        "line_tokens": len(record["line"])})
    print(json.dumps(summary) if args.json else "\n".join(
        f"{row['fields']} -> {row['out']}" for row in summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
