"""A toy language model around ONE real Megatron MoE layer (embedding -> MoE -> LM head),
for analysis tests that must not depend on the model provider. Built inside a gloo rank."""
from dataclasses import replace

import torch
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.layers.builders import parts

VOCAB, HIDDEN, LATENT, EXPERTS = 32, 16, 8, 6


def toy_config(variant="multi_view", num_routers=2, topk=2, **overrides):
    num_views = num_routers if variant == "multi_view" else 1
    base = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=topk, moe_variant=variant, latent_size=LATENT,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=num_views),
        moe_ffn_hidden_size=12, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, gradient_accumulation_fusion=False)
    base.update(overrides)
    return MVMoETransformerConfig(**base)


def build_layer(config, pg, stock_router=False):
    from megatron_mvmoe.layers.latent_moe import LatentMoELayer
    from megatron_mvmoe.layers.multi_view_moe import MultiViewMoELayer
    from megatron_mvmoe.routing.router import MultiRouter

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=False)
    submodules = parts(spec).submodules
    if not stock_router:
        submodules = replace(submodules, router=MultiRouter)
    cls = MultiViewMoELayer if config.moe_variant == "multi_view" else LatentMoELayer
    layer = cls(config=config, submodules=submodules, layer_number=1, pg_collection=pg)
    with torch.no_grad():  # visible routing differences between heads and experts
        gen = torch.Generator().manual_seed(7)
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(0.3 * torch.randn(EXPERTS, generator=gen))
        if hasattr(layer.fc1_latent_proj, "view_perturbations"):
            layer.fc1_latent_proj.view_perturbations.normal_(0.0, 0.5, generator=gen)
    return layer


class ToyLM(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.moe = layer

    def forward(self, tokens_BS):
        hidden_SBD = self.embed[tokens_BS.t()]
        out, _ = self.moe(hidden_SBD)
        return (hidden_SBD + out) @ self.head.t()  # logits [S, B, V]


def token_nll(model, batch):
    """Per-token NLL in [S, B] flattened order (the MoE layer's token order)."""
    tokens_BS, labels_BS = batch
    logits_SBV = model(tokens_BS)
    nll_SB = torch.nn.functional.cross_entropy(
        logits_SBV.reshape(-1, VOCAB), labels_BS.t().reshape(-1), reduction="none")
    return nll_SB


def batches(num, batch=3, seq=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out
