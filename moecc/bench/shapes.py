"""A model's shape as the planner and the rate measurements see it: pure functions of a transformers config."""
from __future__ import annotations

RANK = 8  # LoRA rank the shape rates are timed at; the planner scales other ranks from it
SEQUENCE = 2048  # tokens per sequence in ``moecc bench`` steps; more tokens per step are more sequences


def moe_shape(config) -> dict:
    """The sizes the planner needs from a transformers config: routed experts, attention, vocabulary, layers."""
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or config.n_routed_experts)
    hidden, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dense = min(layers, getattr(config, "first_k_dense_replace", 0) or 0)
    shared = (getattr(config, "n_shared_experts", 0) or 0) * inter
    return {"model_type": config.model_type, "experts": experts, "top_k": config.num_experts_per_tok,
            "hidden": hidden, "inter": inter,
            "shared_inter": shared + (getattr(config, "shared_expert_intermediate_size", 0) or 0),
            "dense_inter": config.intermediate_size, "heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or hidden // heads, "vocab": config.vocab_size,
            "layers": layers, "dense_layers": dense, "moe_layers": layers - dense}


def shape_key(shape: dict) -> str:
    """What a model's shape rates depend on (everything but its number of layers), readable."""
    s = shape
    return (f"{s['model_type']} E{s['experts']} k{s['top_k']} H{s['hidden']} I{s['inter']} "
            f"shared{s['shared_inter']} dense{s['dense_layers']}x{s['dense_inter']} "
            f"attention{s['heads']}/{s['kv_heads']}x{s['head_dim']} vocab{s['vocab']}")
