"""Qwen2-MoE: softmax router plus one shared expert scaled by a sigmoid gate."""
import torch

from .base import MoeFamily


class Qwen2MoeFamily(MoeFamily):
    model_type = "qwen2_moe"
    modeling_module = "transformers.models.qwen2_moe.modeling_qwen2_moe"
    block_class_name = "Qwen2MoeSparseMoeBlock"

    def shared_output(self, block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(block.shared_expert_gate(hidden))  # [T, 1]
        return gate * block.shared_expert(hidden)
