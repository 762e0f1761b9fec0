"""The last pipeline stage's copy of the word embedding on CPU (a platform patch registered in
cpu_patches.ALL_PATCHES, probed by embedding_copy_breaks).

With tied embeddings (Megatron-LM's default) or multi-token prediction at PP > 1, the last
stage keeps its own copy of the word embedding: Megatron-Core 0.19.2 zeroes it and then
all-reduces it from the first stage in `LanguageModule.setup_embeddings_and_output_layer`,
after moving it with `weight.data = weight.data.cuda()` (language_module.py:307). Without
CUDA that line raises, so neither tied embeddings nor MTP could train under PP on CPU. The
patch runs Megatron's own method with `Tensor.cuda` returning the tensor itself for that one
call: the copy stays on the CPU, where every other parameter is, and the all-reduce that
makes the two stages equal is Megatron's (tests/training/test_gpt3_architecture.py trains
tied embeddings at PP 2 to the PP 1 losses)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import SimpleNamespace

import torch

_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"


@contextlib.contextmanager
def _cuda_is_the_cpu():
    """Tensor.cuda() returns the tensor unchanged inside the block (CPU runs only)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def tensor_cuda_stays_on_this_device():
    """For one Megatron call that moves tensors with `.cuda()`: on a CPU machine the tensors
    stay where they are; with CUDA, nothing changes."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _cuda_is_the_cpu()


def embedding_copy_on_cpu() -> None:
    cls = importlib.import_module(_LANGUAGE_MODULE).LanguageModule
    original = cls.setup_embeddings_and_output_layer
    if getattr(original, "_mvmoe_wrapped", False):
        return

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        with _cuda_is_the_cpu():
            return original(self)

    setup_embeddings_and_output_layer._mvmoe_wrapped = True
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _last_stage_with_tied_embeddings():
    """A stand-in for the last of two pipeline stages of a tied model, enough for the method
    to reach its copy-and-all-reduce branch."""
    weight = torch.nn.Parameter(torch.ones(2))
    config = SimpleNamespace(pipeline_model_parallel_size=2, mtp_num_layers=None,
                             init_model_with_meta_device=False, use_mup=False)
    return SimpleNamespace(
        share_embeddings_and_output_weights=True, config=config, vp_stage=None, vp_size=None,
        pp_group=SimpleNamespace(rank=lambda: 1, size=lambda: 2), pre_process=False,
        post_process=True, embd_group=None, shared_embedding_or_output_weight=lambda: weight,
        _is_in_embd_group=lambda: True)


def embedding_copy_breaks() -> bool:
    """Megatron's method on a stand-in last stage, with torch.distributed stubbed as a group of
    one: unpatched, the `.cuda()` before its all-reduce raises without CUDA."""
    cls = importlib.import_module(_LANGUAGE_MODULE).LanguageModule
    dist = torch.distributed
    saved = dist.is_initialized, dist.all_reduce
    dist.is_initialized, dist.all_reduce = (lambda: True), (lambda *args, **kwargs: None)
    try:
        cls.setup_embeddings_and_output_layer(_last_stage_with_tied_embeddings())
    except (AssertionError, RuntimeError):
        return True
    finally:
        dist.is_initialized, dist.all_reduce = saved
    return False
