"""DeepSeek-V3: sigmoid router with correction bias, group-limited top-k and routed scaling (all inside the
HF router module), shared experts, and dense first layers (left untouched on the device)."""
import torch

from .base import MoeFamily


class DeepseekV3Family(MoeFamily):
    model_type = "deepseek_v3"
    modeling_module = "transformers.models.deepseek_v3.modeling_deepseek_v3"
    block_class_name = "DeepseekV3MoE"
    attention_targets = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def shared_output(self, block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return block.shared_experts(hidden)
