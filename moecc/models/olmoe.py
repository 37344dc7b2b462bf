"""OLMoE: softmax router with optional top-k renormalisation, no shared experts (the Qwen3-MoE shape)."""
from .base import MoeFamily


class OlmoeFamily(MoeFamily):
    model_type = "olmoe"
    modeling_module = "transformers.models.olmoe.modeling_olmoe"
    block_class_name = "OlmoeSparseMoeBlock"
