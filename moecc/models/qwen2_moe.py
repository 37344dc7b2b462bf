"""Qwen2-MoE: softmax router plus one shared expert scaled by a sigmoid gate."""
import torch

from .base import MoeFamily


class Qwen2MoeFamily(MoeFamily):
    model_type = "qwen2_moe"
    modeling_module = "transformers.models.qwen2_moe.modeling_qwen2_moe"
    block_class_name = "Qwen2MoeSparseMoeBlock"

    def forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, layer) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.view(-1, shape[-1])  # [T, H]
        shared = block.shared_expert(hidden)  # [T, H]; the original computes it before routing
        _, top_k_weights, top_k_index = block.gate(hidden)
        pending = layer.submit(hidden, top_k_index, top_k_weights)
        shared = torch.sigmoid(block.shared_expert_gate(hidden)) * shared  # overlaps the CPU experts
        return (pending.result() + shared).reshape(shape)
