"""Qwen3-MoE: softmax router with optional top-k renormalisation, no shared experts."""
from .base import MoeFamily


class Qwen3MoeFamily(MoeFamily):
    model_type = "qwen3_moe"
    modeling_module = "transformers.models.qwen3_moe.modeling_qwen3_moe"
    block_class_name = "Qwen3MoeSparseMoeBlock"
