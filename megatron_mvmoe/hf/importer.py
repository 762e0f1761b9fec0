"""A Hugging Face directory (ours, or a stock Llama / Mixtral / Qwen3Moe / Glm4Moe one) -> our
checkpoint.

Design choices:
- The run's model comes from config.json: our class carries the source run's whole model
  section (`megatron_mvmoe`), and its top-level fields must agree with it; a stock class's
  fields map back through the table of hf/config_map.py (every field it does not express
  is refused, naming it).
- The weights are renamed back (`names`), checked name by name and shape by shape against
  the model the run builds, loaded strictly, and saved by the trainer's own
  `save_checkpoint` at step 0 (manifest, fingerprint, run_state; weights only, as the trainer
  writes before a first step), so `--load` resumes it (a fresh optimizer) and dist-checkpointing reshards it to
  any TP/PP/EP layout the trainer runs at. The import runs on one process at TP=PP=EP=1;
  the layout flags are checked against the model now (the trainer uses them on resume).
- The LR/WD schedule: the source run's when the export recorded it (config.json's
  `megatron_mvmoe_source.scheduler`, Megatron's scheduler state at the source step);
  otherwise the checkpoint carries none, and a resume takes its own run's schedule and
  says so (training/checkpoint.py), never a placeholder.
- A dense HF decoder (Llama) imports as our dense model: the trainer's
  --warm-start-from upcycles it into an MoE of the same shape, or refuses naming the
  field that differs (models/warm_start.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch

from megatron_mvmoe.errors import require
from megatron_mvmoe.hf import config_map, names, writer

_SHAPE_FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
                 "num_attention_heads": "num_attention_heads", "vocab_size": "vocab_size"}


def read_config(hf_dir: str) -> Dict:
    path = os.path.join(hf_dir, "config.json")
    require(os.path.isfile(path), path, "missing", "pass a directory written by "
            "tools/export_hf.py or a transformers save_pretrained()")
    with open(path) as fh:
        return json.load(fh)


def hf_class_of(cfg: Dict, hf_dir: str) -> str:
    arch = (cfg.get("architectures") or [None])[0]
    require(arch in config_map.STOCK_CLASSES + (config_map.OURS,),
            f"{hf_dir}/config.json: architectures", f"{arch!r} is not imported",
            f"import one of {config_map.STOCK_CLASSES + (config_map.OURS,)}")
    return arch


def read_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the directory (index + shards, or one model.safetensors)."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, writer.INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: Dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        require(os.path.isfile(path), path, "missing (named by the index)",
                "copy the whole exported directory, or export it again")
        state.update(load_file(path))
    return state


def _ours_section(cfg: Dict, hf_dir: str) -> Dict:
    section = dict(cfg.get("megatron_mvmoe") or {})
    require(bool(section), f"{hf_dir}/config.json: megatron_mvmoe", "missing",
            "export the model again with tools/export_hf.py")
    for hf_field, ours in _SHAPE_FIELDS.items():
        require(cfg.get(hf_field) == section.get(ours), f"{hf_dir}/config.json: {hf_field}",
                f"{cfg.get(hf_field)} disagrees with the model section's {ours}="
                f"{section.get(ours)}", "export the model again (the config was edited)")
    return section


def _stock_section(cfg: Dict, arch: str, hf_dir: str) -> Dict:
    where = f"{hf_dir}/config.json"
    rope = cfg.get("rope_parameters") or {"rope_type": "default",
                                          "rope_theta": cfg.get("rope_theta", 10000.0)}
    for field_, ok in (("tie_word_embeddings", not cfg.get("tie_word_embeddings", False)),
                       ("attention_bias", not cfg.get("attention_bias", False)),
                       ("mlp_bias", not cfg.get("mlp_bias", False)),
                       ("hidden_act", cfg.get("hidden_act", "silu") == "silu"),
                       ("rope_parameters.rope_type", rope.get("rope_type") == "default"),
                       ("rope_parameters.partial_rotary_factor",
                        rope.get("partial_rotary_factor", 1.0) == 1.0),
                       ("use_qk_norm", not cfg.get("use_qk_norm", False)),
                       ("use_sliding_window", not cfg.get("use_sliding_window", False))):
        require(ok, f"{where}: {field_}", f"{cfg.get(field_.split('.')[0])!r} is not "
                "expressed by our model", "import a checkpoint without it")
    heads = cfg["num_attention_heads"]
    extra = {"layernorm_epsilon": cfg.get("rms_norm_eps", 1e-5)}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim != cfg["hidden_size"] // heads:
        extra["kv_channels"] = head_dim
    section = dict(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   num_attention_heads=heads,
                   num_query_groups=_query_groups(cfg.get("num_key_value_heads"), heads),
                   ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                   seq_length=cfg.get("max_position_embeddings", 2048),
                   rotary_base=int(rope["rope_theta"]), extra=extra)
    if arch == "LlamaForCausalLM":
        # the dense FFN width as the would-be expert width (what the tiny presets write;
        # models/fast_paths.py reads it for every variant)
        return dict(section, moe_variant="dense", moe_ffn_hidden_size=cfg["intermediate_size"])
    section.update(moe_variant="smoe", moe_router_topk=cfg["num_experts_per_tok"])
    if arch == "MixtralForCausalLM":
        return dict(section, num_experts=cfg["num_local_experts"],
                    moe_ffn_hidden_size=cfg["intermediate_size"])
    if arch == "Qwen3MoeForCausalLM":
        return dict(section, **_qwen3_moe_fields(cfg, where, extra))
    return dict(section, **_glm4_moe_fields(cfg, where, extra))


def _query_groups(kv_heads: Optional[int], heads: int) -> Optional[int]:
    """Our spelling: None means one group per head (as the presets write it)."""
    return None if kv_heads in (None, heads) else kv_heads


def _qwen3_moe_fields(cfg: Dict, where: str, extra: Dict) -> Dict:
    """Qwen3-MoE: Mixtral's routing when norm_topk_prob, every layer MoE, QK norm."""
    for field_, ok in (("norm_topk_prob", cfg.get("norm_topk_prob") is True
                        or cfg["num_experts_per_tok"] == 1),
                       ("decoder_sparse_step", cfg.get("decoder_sparse_step", 1) == 1),
                       ("mlp_only_layers", not cfg.get("mlp_only_layers"))):
        require(ok, f"{where}: {field_}", f"{cfg.get(field_)!r} is not expressed by our "
                "model (softmax over the top-k, every layer MoE)",
                "import a checkpoint without it")
    extra["qk_layernorm"] = True
    return dict(num_experts=cfg["num_experts"], moe_ffn_hidden_size=cfg["moe_intermediate_size"])


def _glm4_moe_fields(cfg: Dict, where: str, extra: Dict) -> Dict:
    topk = cfg["num_experts_per_tok"]
    for field_, value in (("n_group", 1), ("topk_group", 1), ("first_k_dense_replace", 0),
                          ("norm_topk_prob", topk > 1)):
        require(cfg.get(field_) == value, f"{where}: {field_}", f"{cfg.get(field_)!r} is not "
                f"expressed by our model (it computes with {value!r})",
                "import a checkpoint without it")
    width = cfg["moe_intermediate_size"]
    extra.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if cfg.get("routed_scaling_factor", 1.0) != 1.0:
        extra["moe_router_topk_scaling_factor"] = cfg["routed_scaling_factor"]
    return dict(num_experts=cfg.get("n_routed_experts") or cfg["num_local_experts"],
                moe_ffn_hidden_size=width,
                moe_shared_expert_intermediate_size=width * cfg["n_shared_experts"])


def model_section(cfg: Dict, arch: str, hf_dir: str) -> Dict:
    """The run config's `model` mapping for the directory's config.json."""
    if arch == config_map.OURS:
        return _ours_section(cfg, hf_dir)
    return _stock_section(cfg, arch, hf_dir)


def megatron_state(arch: str, cfg: Dict, hf: Dict[str, torch.Tensor], config, types):
    """The directory's weights under Megatron's names for the built model's `config`."""
    if arch == config_map.OURS:
        return names.from_mvmoe(hf)
    from megatron_mvmoe.hf.export import stock_names

    return stock_names(arch, config, types).from_hf(
        hf, with_expert_bias=bool(config.moe_router_enable_expert_bias))


def check_against_model(state: Dict[str, torch.Tensor], model_state: Dict, hf_dir: str):
    """Every weight the model has, with its shape; nothing extra."""
    expected = names.weights_only(model_state)
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    require(not missing and not unknown, f"{hf_dir}: weights",
            f"{_listed(missing)} the config's model needs are missing; {_listed(unknown)} "
            "in the directory have no place in it (a renamed weight shows in both)",
            "the config.json does not describe these weights: fix it or export the model "
            "again")
    for name, tensor in expected.items():
        require(tuple(state[name].shape) == tuple(tensor.shape), f"{hf_dir}: {name}",
                f"shape {tuple(state[name].shape)} but config.json gives "
                f"{tuple(tensor.shape)}", "fix config.json or export again")


def _listed(names_: list, shown: int = 3) -> str:
    """'2 [a, b]' or '7 [a, b, c, ...]' ('0' when empty)."""
    if not names_:
        return "0"
    more = ", ..." if len(names_) > shown else ""
    return f"{len(names_)} [{', '.join(names_[:shown])}{more}]"


def run_mapping(section: Dict, parallel: Dict, tokenizer_json: Optional[str]) -> Dict:
    raw = {"model": section, "parallel": dict(parallel),
           "training": {"ckpt_optimizer_format": "fully_reshardable"},
           "logging": {"tensorboard": False}}
    if tokenizer_json is not None:
        raw["data"] = {"tokenizer_type": "HuggingFaceTokenizer",
                       "tokenizer_model": tokenizer_json}
    return raw


def import_directory(hf_dir: str, save: str, layout: Optional[Dict] = None) -> Dict:
    """Write our checkpoint for `hf_dir` under `save`; returns a summary."""
    import time

    from megatron_mvmoe.parallel import ParallelLayout

    start = time.time()
    cfg = read_config(hf_dir)
    arch = hf_class_of(cfg, hf_dir)
    section = model_section(cfg, arch, hf_dir)
    layout = {k: v for k, v in (layout or {}).items() if v is not None}
    target = ParallelLayout(**layout)
    world = target.smallest_world_size()
    target.validate(world, section["num_layers"], section.get("num_experts"))
    require(not os.path.exists(os.path.join(save, "latest")), "--save",
            f"{save} already holds a checkpoint", "choose a new directory")
    hf = read_weights(hf_dir)
    source = cfg.get("megatron_mvmoe_source") or {}
    step, schedule = int(source.get("step", 0)), source.get("scheduler")
    summary = _save(hf_dir, save, cfg, arch, section, hf, schedule)
    return dict(summary, hf=hf_dir, save=save, hf_class=arch, source_step=step,
                schedule="the source run's" if schedule is not None else "none",
                checked_layout=layout or {"tp": 1}, seconds=time.time() - start,
                bytes=writer.directory_bytes(save))


def _save(hf_dir, save, cfg, arch, section, hf, schedule: Optional[Dict]) -> Dict:
    from megatron_mvmoe.checkpointing.weights import set_model_weights
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.toolkit.checkpoint import tool_session
    from megatron_mvmoe.training.build import build_trainer
    from megatron_mvmoe.training.checkpoint import ResumeState, save_checkpoint

    tokenizer_json = _copy_tokenizer(hf_dir, save)
    run = config_from_dict(run_mapping(section, {}, tokenizer_json))
    with tool_session(run) as pgs:
        trainer = build_trainer(run, pgs)
        chunk = trainer.unwrapped()[0]
        model_state = chunk.state_dict()
        types = config_map.layer_types(model_state, chunk.config.num_layers)
        state = megatron_state(arch, cfg, hf, chunk.config, types)
        check_against_model(state, model_state, hf_dir)
        full = {k: (state[k] if k in state else v) for k, v in model_state.items()}
        set_model_weights([chunk], {"model0": full})
        gamma = _gamma(state)
        _carry_schedule(trainer, schedule)
        # step 0: the trainer writes a weights-only checkpoint (no optimizer state exists
        # before a first step); the source step stays in the summary
        path = save_checkpoint(trainer, save, ResumeState(step=0, gamma=gamma))
    return {"checkpoint": path, "tensors": len(state)}


def _carry_schedule(trainer, schedule: Optional[Dict]) -> None:
    """The imported checkpoint's LR/WD schedule: the source run's, as its export recorded it
    (Megatron's scheduler state, its step included), or none at all, so that a resume
    takes its own run's schedule and says so (never this import's placeholder optimizer
    section)."""
    if schedule is None:
        trainer.scheduler = None  # training/checkpoint.py saves no scheduler part then
    else:
        trainer.scheduler.load_state_dict(schedule)


def _gamma(state: Dict[str, torch.Tensor]) -> Optional[float]:
    ramp = config_map.gamma_state(state)
    if ramp is None:
        return None
    return 1.0 if ramp[0] == 0 else min(1.0, ramp[1] / ramp[0])


def _copy_tokenizer(hf_dir: str, save: str) -> Optional[str]:
    source = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(source):
        return None
    os.makedirs(os.path.join(save, "tokenizer"), exist_ok=True)
    target = os.path.abspath(os.path.join(save, "tokenizer", "tokenizer.json"))
    shutil.copyfile(source, target)
    return target
