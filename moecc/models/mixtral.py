"""Mixtral: softmax router (float32 routing weights, always renormalised), optional router jitter noise."""
import torch

from .base import MoeFamily


class MixtralFamily(MoeFamily):
    model_type = "mixtral"
    modeling_module = "transformers.models.mixtral.modeling_mixtral"
    block_class_name = "MixtralSparseMoeBlock"

    def forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, layer) -> torch.Tensor:
        if block.training and block.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - block.jitter_noise,
                                                                      1.0 + block.jitter_noise)
        return super().forward(block, hidden_states, layer)
