"""Small random-weight MoE models of every supported family, for tests, examples and the demo fine-tune.

Shapes are tiny but keep what matters: several experts, top-k >= 2, at least two layers, shared experts and
dense layers where the family has them. ``overrides`` change any config field.
"""
from __future__ import annotations

import torch

TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512,
    ),
    "qwen2_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=512,
    ),
    "deepseek_v3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=512,
    ),
    "deepseek_v2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=1.5, max_position_embeddings=512,
    ),
    "mixtral": dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
        max_position_embeddings=512,
    ),
    "olmoe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
        max_position_embeddings=512,
    ),
    "gpt_oss": dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
    ),
}


def tiny_config(family: str, **overrides):
    """A transformers config of ``family`` with tiny shapes (see ``TINY_CONFIGS``)."""
    from transformers import AutoConfig

    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; choose one of {', '.join(TINY_CONFIGS)}")
    return AutoConfig.for_model(family, **{**TINY_CONFIGS[family], **overrides})


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, router_scale: float = 0.5,
               expert_scale: float = 0.08, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of ``family`` in host memory, reproducible from ``seed``.

    Routers (std ``router_scale``) and routed experts (std ``expert_scale``) get larger weights than HF's
    default init, so routing clearly depends on the token and the experts visibly shape the output.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * router_scale)
            elif "experts.gate_up_proj" in name or "experts.down_proj" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * expert_scale)
    return model.eval()
