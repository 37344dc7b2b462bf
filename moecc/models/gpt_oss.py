"""gpt-oss: router with bias, top-k then softmax; experts stored transposed (``gate_up_proj [E, H, 2I]``) with
gate/up interleaved, biases, and a clamped SwiGLU (``alpha``, ``limit``). The block returns
``(hidden_states, router_scores)``."""
import torch

from .base import MoeFamily


class GptOssFamily(MoeFamily):
    model_type = "gpt_oss"
    modeling_module = "transformers.models.gpt_oss.modeling_gpt_oss"
    block_class_name = "GptOssMLP"

    def check_config(self, config) -> None:
        """gpt-oss declares hidden_act='silu' but its experts use their own clamped SwiGLU, which moecc runs."""

    def forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, layer) -> tuple:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])  # [T, H]
        _, router_scores, router_indices = block.router(hidden)
        out = layer.submit(hidden, router_indices, router_scores).result()
        return out.reshape(shape), router_scores
