"""BitNet everywhere in the decoder block (seed 001, Table 3) for every MoE variant.

- The block spec holds no full-precision Column/RowParallelLinear once bitnet.enabled.
- In a real tiny GPTModel forward, EVERY matrix entering a GEMM (F.linear / matmul / mm /
  addmm) is ternary x one scale and never a parameter's own storage, except the routers'
  and the output layer's (full precision by design); attention, dense MLP, experts, shared
  experts, the latent / view projections and MH-MoE's head / merge are all seen quantized.
- A tiny BitNet Multi-View GPT trains: the loss on a fixed batch falls.
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.overrides import TorchFunctionMode

from megatron_mvmoe.config.transformer_config import BitNetConfig, MultiHeadConfig
from megatron_mvmoe.layers.bitnet import BitColumnParallelLinear, BitRowParallelLinear
from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.platform import seed_all
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

VOCAB, SEQ, BATCH = 64, 8, 2
GEMMS = {F.linear: 1, torch.matmul: 1, torch.Tensor.matmul: 1, torch.mm: 1,
         torch.Tensor.mm: 1, torch.addmm: 2}  # op -> index of the weight operand


def _config(variant, **overrides):
    extra = dict(moe_shared_expert_intermediate_size=40, moe_layer_freq=[0, 1])
    if variant == "mh_moe":
        extra.update(latent_size=None, num_routers=1,
                     multi_head=MultiHeadConfig(num_heads=2))
    extra.update(overrides)
    return mv_config(variant, bitnet=BitNetConfig(enabled=True), **extra)


def _gpt(config, pgs):
    spec = build_decoder_block_spec(config)
    seed_all(0)  # also Megatron's model-parallel RNG tracker (attention dropout scope)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="learned_absolute", pg_collection=pgs)


def _batch(seed=3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


class _RecordGemmWeights(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = GEMMS.get(func)
        if index is not None and len(args) > index and args[index].dim() == 2:
            self.weights.append(args[index].detach())
        return func(*args, **kwargs)


def _is_ternary_times_scale(w):
    values = w.abs()[w != 0]
    return values.numel() > 0 and bool((values == values[0]).all())


def _ternary_blocks(w, max_blocks=4):
    """How many equal row blocks of `w` are each ternary x one scale (the Multi-View views
    GEMM stacks K such matrices, one per view); 0 when none fits."""
    for blocks in range(1, max_blocks + 1):
        if w.shape[0] % blocks == 0 and all(map(_is_ternary_times_scale, w.chunk(blocks))):
            return blocks
    return 0


def _storage(t):
    return t.untyped_storage().data_ptr()


def _gemm_worker(rank, world_size, variant):
    pgs = initialize_layout(ParallelLayout())
    config = _config(variant)
    model = _gpt(config, pgs)
    full_precision = {_storage(p): n for n, p in model.named_parameters()
                      if "router" in n or n.startswith("output_layer")}
    params = {_storage(p): n for n, p in model.named_parameters()}
    tokens, labels, positions = _batch()
    with _RecordGemmWeights() as rec:
        model(tokens, positions, None, labels=labels).mean().backward()
    raw, ternary, other, shapes = [], 0, [], set()
    for w in rec.weights:
        if _storage(w) in full_precision:
            continue
        if _storage(w) in params:
            raw.append(params[_storage(w)])
        elif _ternary_blocks(w.t() if w.shape[0] < w.shape[1] else w):
            ternary += 1
            shapes.add(tuple(sorted(w.shape)))
        else:
            other.append(tuple(w.shape))
    return {"raw": raw, "ternary": ternary, "other": other, "shapes": shapes,
            "modules": {type(m).__name__ for m in model.decoder.modules()}}


def _expected_shapes(variant):
    D, F_, L, shared, moe_ffn = 32, 64, 16, 40, 24
    shapes = {(D, 3 * D), (D, D), (D, F_), (D, shared)}  # attention, dense MLP, shared expert
    if variant == "mh_moe":
        return shapes | {(D // 2, moe_ffn)}  # experts on D/H sub-tokens (+ head/merge: D x D)
    views = {"latent": 1, "multi_view": 2}[variant]
    return shapes | {(L, moe_ffn), (D, views * L), (L, D)}  # experts, views, up-projection


@pytest.mark.parametrize("variant", ["latent", "multi_view", "mh_moe"])
def test_every_gemm_weight_is_ternary_except_routers_and_output(variant):
    out = run_distributed(_gemm_worker, 1, args=(variant,))[0]
    assert out["raw"] == [], f"parameters used unquantized: {out['raw']}"
    assert out["other"] == [], f"GEMM operands that are not ternary x scale: {out['other']}"
    expected = {tuple(sorted(shape)) for shape in _expected_shapes(variant)}
    assert expected <= out["shapes"], (expected - out["shapes"])
    assert "ColumnParallelLinear" not in out["modules"]
    assert "RowParallelLinear" not in out["modules"]
    assert {"BitColumnParallelLinear", "BitRowParallelLinear"} <= out["modules"]


def _classes(value, found):
    if isinstance(value, type):
        found.add(value)
    elif isinstance(value, ModuleSpec):
        _classes(value.module, found)
        _classes(value.submodules, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _classes(v, found)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _classes(getattr(value, name), found)
    return found


def _spec_worker(rank, world_size):
    initialize_layout(ParallelLayout())
    found = _classes(build_decoder_block_spec(_config("multi_view"), use_te=False), set())
    errors = []
    # TE under BitNet is refused by the block spec; grouped GEMM already by the config
    for overrides, use_te in (({}, True), ({"moe_grouped_gemm": True}, False)):
        try:
            build_decoder_block_spec(_config("multi_view", **overrides), use_te=use_te)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return found, errors


def test_block_spec_is_bitnet_and_te_or_grouped_gemm_refused():
    found, (te_error, grouped_error) = run_distributed(_spec_worker, 1)[0]
    assert ColumnParallelLinear not in found and RowParallelLinear not in found
    assert {BitColumnParallelLinear, BitRowParallelLinear} <= found
    assert te_error is not None and te_error.startswith("bitnet.enabled")
    assert grouped_error is not None and grouped_error.startswith("moe_grouped_gemm")


def _train_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    model = _gpt(_config("multi_view"), pgs)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, labels, positions = _batch()
    losses = []
    for _ in range(12):
        loss = model(tokens, positions, None, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tiny_bitnet_multi_view_gpt_trains():
    losses = run_distributed(_train_worker, 1)[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses


def test_bitnet_views_are_one_ternary_matrix_each_and_exact_at_gamma_zero():
    from megatron_mvmoe.functional.quantize import quantize_activation_ste, quantize_weight_ste
    from megatron_mvmoe.views import MultiViewProjection

    config = _config("multi_view", num_routers=3)
    proj = MultiViewProjection(config)
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    views = proj(h, 0.0)
    assert all(torch.equal(views[:, m], views[:, 0]) for m in range(3))
    views = proj(h, 0.5)
    h_norm = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)  # BitLinear's RMSNorm
    h_q = quantize_activation_ste(h_norm, 8)
    for m in range(1, 3):
        w = quantize_weight_ste(proj.weight + 0.5 * proj.view_perturbations[m - 1])
        torch.testing.assert_close(views[:, m], h_q @ w.t(), atol=1e-6, rtol=0)
    assert not torch.allclose(views[:, 1], views[:, 0])
