"""MVMoEConfig: the transformers configuration of a megatron_mvmoe model exported for
`trust_remote_code=True` (written next to modeling_mvmoe.py by tools/export_hf.py).

Every field is one Megatron-Core / megatron_mvmoe setting under a transformers-style name;
`megatron_mvmoe` holds the whole model section of the source run, so tools/import_hf.py
rebuilds the very run config the checkpoint was trained with. Imports only transformers.
"""

from transformers import PretrainedConfig


class MVMoEConfig(PretrainedConfig):
    """Decoder-only MoE LM: RMSNorm, RoPE, GQA (optionally QK-normed) or multi-latent
    attention, SwiGLU; the MLP of each layer is dense or
    one of the MoE variants (smoe, latent, multi_router, multi_view, mh_moe), optionally
    BitNet b1.58 quantized."""

    model_type = "mvmoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=512, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, head_dim=None,
                 intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=2048, moe_variant="smoe", mlp_layer_types=None,
                 num_experts=4, moe_intermediate_size=64, num_experts_per_tok=2,
                 router_score_function="softmax", router_pre_softmax=False,
                 router_topk_scaling_factor=None, router_expert_bias=False,
                 shared_expert_intermediate_size=None, latent_size=None, num_routers=1,
                 num_views=1, normalizer_eps=1e-6, gate_scale=1.0, learned_gate_scale=False,
                 gamma_ramp_steps=0, gamma_step=0, mh_num_heads=1, mh_head_projection=True,
                 mh_merge_projection=True, bitnet=False, bitnet_activation_bits=8,
                 bitnet_input_norm=True, megatron_mvmoe=None, tie_word_embeddings=False,
                 qk_layernorm=False, router_num_groups=None, router_group_topk=None,
                 shared_expert_gate=False, multi_latent_attention=False, q_lora_rank=None,
                 kv_lora_rank=None, qk_head_dim=None, qk_pos_emb_head_dim=None,
                 v_head_dim=None, rope_type="rope", rotary_scaling_factor=1.0,
                 original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                 mscale=1.0, mscale_all_dim=0.0, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.moe_variant = moe_variant
        default_type = "dense" if moe_variant == "dense" else "moe"
        self.mlp_layer_types = list(mlp_layer_types or [default_type] * num_hidden_layers)
        self.num_experts = num_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.router_score_function = router_score_function
        self.router_pre_softmax = router_pre_softmax
        self.router_topk_scaling_factor = router_topk_scaling_factor
        self.router_expert_bias = router_expert_bias
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.latent_size = latent_size
        self.num_routers = num_routers
        self.num_views = num_views
        self.normalizer_eps = normalizer_eps
        self.gate_scale = gate_scale
        self.learned_gate_scale = learned_gate_scale
        self.gamma_ramp_steps = gamma_ramp_steps
        self.gamma_step = gamma_step
        self.mh_num_heads = mh_num_heads
        self.mh_head_projection = mh_head_projection
        self.mh_merge_projection = mh_merge_projection
        self.bitnet = bitnet
        self.bitnet_activation_bits = bitnet_activation_bits
        self.bitnet_input_norm = bitnet_input_norm
        self.megatron_mvmoe = megatron_mvmoe or {}
        # Megatron-LM's attention and routing options (issue 36): QK norm, group-limited
        # routing, the shared expert's sigmoid gate, multi-latent attention with its RoPE
        self.qk_layernorm = qk_layernorm
        self.router_num_groups = router_num_groups
        self.router_group_topk = router_group_topk
        self.shared_expert_gate = shared_expert_gate
        self.multi_latent_attention = multi_latent_attention
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_head_dim = qk_head_dim
        self.qk_pos_emb_head_dim = qk_pos_emb_head_dim
        self.v_head_dim = v_head_dim
        self.rope_type = rope_type
        self.rotary_scaling_factor = rotary_scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = mscale
        self.mscale_all_dim = mscale_all_dim
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def gamma(self) -> float:
        """The views' gamma at the exported step (views.schedule.GammaRamp's rule)."""
        if self.gamma_ramp_steps == 0:
            return 1.0
        return min(1.0, self.gamma_step / self.gamma_ramp_steps)
