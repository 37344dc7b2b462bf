"""DeepSeek-V3: sigmoid router with correction bias, group-limited top-k and routed scaling (all inside the
HF router module), shared experts, and dense first layers (left untouched on the device)."""
import torch

from .base import MoeFamily


class DeepseekV3Family(MoeFamily):
    model_type = "deepseek_v3"
    modeling_module = "transformers.models.deepseek_v3.modeling_deepseek_v3"
    block_class_name = "DeepseekV3MoE"
    attention_targets = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, layer) -> torch.Tensor:
        shape = hidden_states.shape
        _, top_k_weights, top_k_index = block.gate(hidden_states)  # weights float32, scaled
        pending = layer.submit(hidden_states.view(-1, shape[-1]), top_k_index, top_k_weights)
        shared = block.shared_experts(hidden_states)  # [B, S, H], overlaps the CPU experts
        return pending.result().view(shape) + shared
