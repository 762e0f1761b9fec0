"""Model presets: tiny CPU demo models per MoE variant, and the 24-layer 10B-A1B Multi-View.

Design choices:
- A preset is a plain dict of `ModelSection` fields (config/model_section.py), our nested
  configs as nested dicts; a run's YAML or flags override single fields, and loading the
  config merges them into the one resolved `ModelSection` that both the model provider and
  the planner read, so the parameter count the planner reports is the one the provider
  builds.
- Tiny presets (D = 64, 2 layers, vocab 4096 = the corpus's small BPE) train at a
  few thousand tokens/s on 2 CPU cores; every variant keeps E = 4, top-2.
- 10B-A1B (seed 000: "24-layer 10B-A1B backbone with top-8 routing and one always-active
  shared expert", latent MoE, R = K = 2, parameter overheads ~0.06 % for Multi-Router and
  ~0.19 % for Multi-View). The seed does not give D, L, E or the expert width; we derive
  them from its figures (README "10B-A1B shape"; tools/plan.py prints the overheads):
    D = 2048, 16 heads with 4 KV groups (GQA), SwiGLU, RMSNorm, RoPE, vocab 50304
    (GPT-2 BPE padded to a multiple of 128), untied embeddings, seq 4096, every layer MoE.
    Multi-Router adds (R-1) E D per layer: 24 E D / 10 B = 0.06 % gives E ~ 122 -> E = 128
    (a power of two: EP = 8 ... 128 all divide it).
    Multi-View adds (R-1) E D + (K-1) L D per layer: 24 D (E + L) / 10 B = 0.19 % gives
    E + L ~ 386 -> latent L = 256 (D / 8).
    Expert width F then sets the total: 10 B = non-expert + 24 x 128 x 3 L F gives
    F ~ 3970 -> 3968 (31 x 128). Shared expert 1024 wide on the full hidden state.
  Result: 10.02 B total (latent baseline 10.00 B), 1.24 B active (1.04 B without
  embeddings); overheads 0.063 % and 0.189 %. The earlier shape (L = 1024, 160 experts of
  width 768: 0.080 % / 0.595 %) stays as `mvmoe_10b_a1b_wide_latent`.
- The one registry: the seed-2 (MH-MoE paper) family of config/seed2_presets.py is
  registered here too, `seed2_<name>` at paper size (D = 768, 12 layers) and
  `seed2_tiny_<name>` at CPU size (D = 96, 4 layers), so `--model-preset` and every tool
  choose any preset by one name, and an unknown name lists them all.
"""

from __future__ import annotations

from typing import Any, Dict, List

from megatron_mvmoe.config import seed2_presets

_TINY_BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  vocab_size=4096, seq_length=64, num_experts=4, moe_ffn_hidden_size=64,
                  moe_router_topk=2)

PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny_dense": dict(_TINY_BASE, moe_variant="dense", num_experts=None,
                       moe_router_topk=None),
    "tiny_smoe": dict(_TINY_BASE, moe_variant="smoe"),
    "tiny_latent": dict(_TINY_BASE, moe_variant="latent", latent_size=32),
    "tiny_multi_router": dict(_TINY_BASE, moe_variant="multi_router", latent_size=32,
                              multi_view=dict(num_routers=2)),
    "tiny_multi_view": dict(_TINY_BASE, moe_variant="multi_view", latent_size=32,
                            multi_view=dict(num_routers=2, num_views=2, gamma_ramp_steps=20)),
    "tiny_mh_moe": dict(_TINY_BASE, moe_variant="mh_moe", multi_head=dict(num_heads=2)),
    "mvmoe_10b_a1b": dict(
        moe_variant="multi_view", num_layers=24, hidden_size=2048, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=8192, num_experts=128, moe_ffn_hidden_size=3968,
        moe_router_topk=8, moe_shared_expert_intermediate_size=1024, latent_size=256,
        multi_view=dict(num_routers=2, num_views=2, gamma_ramp_steps=2000), vocab_size=50304,
        seq_length=4096),
}
PRESETS["mvmoe_10b_a1b_wide_latent"] = dict(PRESETS["mvmoe_10b_a1b"], num_experts=160,
                                            moe_ffn_hidden_size=768, latent_size=1024)
# ^ the shape before issue 15: 9.84 B / 1.23 B, but 0.080 % / 0.595 % overheads.
for _name in ("mvmoe_10b_a1b", "mvmoe_10b_a1b_wide_latent"):
    PRESETS[f"{_name}_baseline"] = dict(PRESETS[_name], moe_variant="latent", multi_view=dict(
        num_routers=1, num_views=1, gamma_ramp_steps=0))

for _size, _prefix in (("paper", "seed2_"), ("tiny", "seed2_tiny_")):
    for _name in seed2_presets.family_names():
        PRESETS[_prefix + _name] = seed2_presets.get_preset(_name, size=_size).model_fields()

# Layouts for the 10B-A1B model by GPU count: (tp, pp, ep). EP spans the data-parallel
# ranks; TP stays inside a node; PP only when a replica no longer fits (see tools/plan.py).
LAYOUTS_10B: Dict[int, Dict[str, int]] = {
    8: dict(tp=1, pp=1, ep=8),
    16: dict(tp=1, pp=2, ep=8),
    32: dict(tp=2, pp=2, ep=8),
    64: dict(tp=2, pp=2, ep=16),
    128: dict(tp=2, pp=4, ep=16),
    256: dict(tp=2, pp=4, ep=32),
}


def preset_names() -> List[str]:
    """Every registered preset (ours and the seed-2 family), sorted."""
    return sorted(PRESETS)
