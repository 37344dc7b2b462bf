"""DeepSeek-V2 and -V3: routed experts plus shared experts, dense first layers (left untouched on the device).

V3 routes with a sigmoid, a correction bias, group-limited top-k and routed scaling; V2 with a softmax and
greedy or group-limited-greedy top-k. Both live inside the Hugging Face router module, which runs unchanged.
"""
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


class DeepseekV2Family(DeepseekV3Family):
    model_type = "deepseek_v2"
    modeling_module = "transformers.models.deepseek_v2.modeling_deepseek_v2"
    block_class_name = "DeepseekV2Moe"
