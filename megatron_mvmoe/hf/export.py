"""A trained checkpoint (any TP/PP/EP layout) -> a self-contained Hugging Face directory.

Design choices:
- The checkpoint is read the way every tool reads one (`toolkit/checkpoint.py`): its
  run config, the model built by `models/build.build_model` and filled by
  dist-checkpointing, verified and fingerprint-checked, but on ONE process at TP = PP = EP = 1:
  Megatron's dist-checkpointing gathers every TP/PP/EP shard of a torch_dist checkpoint into
  the whole tensors (over gloo on CPU), so nothing here re-implements a reshard.
- The class is chosen by `config_map.choose_class`; names and layouts by `names`; the
  directory is written atomically by `writer`.
- Every refusal happens before the output directory is created.
- config.json's `megatron_mvmoe_source` records the source step and the checkpoint's LR/WD
  schedule (Megatron's scheduler state), so tools/import_hf.py carries it back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.errors import require
from megatron_mvmoe.hf import config_map, names, writer


@dataclass
class LoadedCheckpoint:
    """What an export needs from a checkpoint, read on one process."""

    config: object
    """The model's MVMoETransformerConfig."""
    model_section: object
    """The run's ModelSection."""
    state: Dict[str, torch.Tensor]
    """The whole model's Megatron state dict (weights only)."""
    tokenizer: object
    step: int
    schedule: Optional[Dict] = None
    """The checkpoint's LR/WD scheduler state (None: it has none)."""


def read_checkpoint(load: str) -> LoadedCheckpoint:
    """Collective over a world of one: the checkpoint's whole model on this process."""
    from megatron_mvmoe.toolkit.checkpoint import (checkpoint_run_config, load_model,
                                                   run_tokenizer, tool_session,
                                                   with_layout)

    run = with_layout(checkpoint_run_config(load), dict(tp=1, pp=1, ep=1, etp=1))
    require(dist.is_initialized() is False or dist.get_world_size() == 1, "world size",
            "the export gathers every shard on one process", "run it without torchrun")
    saved_vpp, run.parallel.vpp = run.parallel.vpp, None
    run.parallel.pp_layout = None  # it places the layers on the saved pp, here 1
    with tool_session(run) as pgs:
        require(dist.get_world_size() == 1, "world size", f"{dist.get_world_size()} ranks: "
                "the export gathers every shard on one process", "run it without torchrun")
        loaded = load_model_gathered(load_model, run, load, pgs, saved_vpp)
        chunk = loaded.model[0]
        state = names.weights_only(chunk.state_dict())
        return LoadedCheckpoint(chunk.config, run.model, state, run_tokenizer(run),
                                loaded.step, _schedule(load))


def _schedule(load: str) -> Optional[Dict]:
    """The scheduler state in the run_state.json of the checkpoint `load` names."""
    from megatron_mvmoe.checkpointing.directory import read_run_state, resolve_checkpoint

    return read_run_state(resolve_checkpoint(load)).get("scheduler")


def load_model_gathered(load_model, run, load: str, pgs, saved_vpp):
    """load_model at one rank; a virtual-pipeline checkpoint (one state dict per chunk,
    `model0..model<v-1>`) cannot be gathered into one chunk and is refused naming it."""
    require(not saved_vpp, "parallel.vpp", f"the checkpoint was saved with {saved_vpp} "
            "virtual pipeline stages (one model<i> entry per stage), which one chunk cannot "
            "load", "resume it once without --num-layers-per-virtual-pipeline-stage and "
            "save, then export that checkpoint")
    return load_model(run, load, pgs)


def export_checkpoint(load: str, out: str, hf_class: str = "auto",
                      max_shard_bytes: int = 2 * 1024 ** 3, overwrite: bool = False) -> Dict:
    """Write the HF directory `out` for the checkpoint at `load`; returns a summary."""
    start = time.time()
    ckpt = read_checkpoint(load)
    read_s = time.time() - start
    return export_loaded(ckpt, out, hf_class, max_shard_bytes, overwrite,
                         extra={"checkpoint": load, "read_s": read_s})


def export_loaded(ckpt: LoadedCheckpoint, out: str, hf_class: str = "auto",
                  max_shard_bytes: int = 2 * 1024 ** 3, overwrite: bool = False,
                  extra: Optional[Dict] = None) -> Dict:
    """The writing half of `export_checkpoint` (all checks first, then the atomic write)."""
    start = time.time()
    config_map.unsupported_settings(ckpt.config)
    config_map.unsupported_architecture(ckpt.model_section)
    types = config_map.layer_types(ckpt.state, ckpt.config.num_layers)
    chosen = config_map.choose_class(ckpt.config, types, hf_class)
    vocab_size = ckpt.state["embedding.word_embeddings.weight"].shape[0]
    hf_cfg = config_map.hf_config(chosen, ckpt.config, ckpt.model_section, types, vocab_size,
                                  config_map.gamma_state(ckpt.state))
    tensors = hf_state(chosen, ckpt.config, types, ckpt.state)
    eod = getattr(ckpt.tokenizer, "eod", None)
    source = {"step": ckpt.step}
    if ckpt.schedule is not None:
        source["scheduler"] = ckpt.schedule
    hf_cfg.update(token_ids(eod), megatron_mvmoe_source=source, dtype=weights_dtype(tensors))
    generation = generation_config(eod, getattr(ckpt.tokenizer, "vocab_size", vocab_size),
                                   vocab_size)

    def fill(directory: str) -> None:
        writer.write_json(f"{directory}/config.json", hf_cfg)
        writer.write_json(f"{directory}/generation_config.json", generation)
        writer.write_shards(directory, tensors, max_shard_bytes)
        eod_token = _eod_token(ckpt.tokenizer)
        if eod_token is not None:
            writer.write_tokenizer(directory, ckpt.tokenizer, eod_token)
        if chosen == config_map.OURS:
            writer.copy_remote_code(directory)

    writer.write_atomically(out, fill, overwrite)
    return dict(extra or {}, out=out, hf_class=chosen, step=ckpt.step,
                variant=ckpt.config.moe_variant, tensors=len(tensors),
                bytes=writer.directory_bytes(out), write_s=time.time() - start)


def hf_state(hf_class: str, config, types, state: Dict[str, torch.Tensor]):
    """The state dict under `hf_class`'s names and layouts."""
    if hf_class == config_map.OURS:
        return names.to_mvmoe(state)
    return stock_names(hf_class, config, types).to_hf(state)


def weights_dtype(tensors: Dict[str, torch.Tensor]) -> str:
    """config.json's `dtype`: that of the word embeddings, as the weights are written (a
    bf16 run's weights are bf16; fp32 buffers such as the expert bias stay fp32)."""
    embedding = next(t for name, t in tensors.items() if name.endswith("embed_tokens.weight")
                     or name.endswith("word_embeddings.weight"))
    return str(embedding.dtype).removeprefix("torch.")


def stock_names(hf_class: str, config, types) -> names.StockNames:
    return names.StockNames(hf_class, config.num_attention_heads,
                            config.num_query_groups or config.num_attention_heads,
                            config.kv_channels, config.num_moe_experts, types)


def token_ids(eod: Optional[int]) -> Dict:
    return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}


def generation_config(eod: Optional[int], tokenizer_vocab: int, model_vocab: int) -> Dict:
    """Greedy by default, stopping at end-of-document; padded embedding rows (ids past the
    tokenizer's vocabulary) are suppressed, as tools/generate.py never picks them."""
    out = dict(token_ids(eod), do_sample=False, _from_model_config=False)
    if model_vocab > tokenizer_vocab:
        out["suppress_tokens"] = list(range(tokenizer_vocab, model_vocab))
    return out


def _eod_token(tokenizer) -> Optional[str]:
    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "_bpe", None)
    eod = getattr(tokenizer, "eod", None)
    if backend is None or eod is None:
        return None
    return backend.id_to_token(eod)
