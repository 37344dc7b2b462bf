"""What every MoE family adapter provides, and how its sparse-block forward is installed.

A family adapter re-states its Hugging Face sparse block's forward with the experts call replaced by
``layer.submit(...)`` / ``.result()``. It keeps the original order of operations, so autograd builds the same
graph in the same order (bf16 gradients then round exactly as in the original), and it queues device work that
does not need the routed output (the shared experts) between submit and result, where it overlaps the CPU.
"""
from __future__ import annotations

import importlib
import types

import torch

from ..errors import UnsupportedModelError


class MoeFamily:
    """Base adapter: softmax-router families without shared experts (the Qwen3-MoE block)."""

    model_type: str = ""
    modeling_module: str = ""  # transformers.models.<x>.modeling_<x>
    block_class_name: str = ""
    attention_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def block_class(self) -> type:
        module = importlib.import_module(self.modeling_module)
        return getattr(module, self.block_class_name)

    def check_config(self, config) -> None:
        """Raises UnsupportedModelError for settings the engine cannot run (e.g. another activation)."""
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"{self.model_type} with hidden_act={act!r}: moecc's expert kernels implement SwiGLU (silu) only"
            )

    def forward(self, block: torch.nn.Module, hidden_states: torch.Tensor, layer) -> torch.Tensor:
        """The sparse block's forward with routed experts on ``layer``; ``hidden_states`` is ``[B, S, H]``."""
        shape = hidden_states.shape
        hidden = hidden_states.view(-1, shape[-1])  # [T, H]
        _, top_k_weights, top_k_index = block.gate(hidden)  # [T, k], [T, k]
        return layer.submit(hidden, top_k_index, top_k_weights).result().reshape(shape)


def install_block_forward(block: torch.nn.Module, family: MoeFamily, layer) -> None:
    """Replaces ``block.forward`` with ``family.forward`` sending routed experts to ``layer``."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return family.forward(self, hidden_states, layer)

    block.forward = types.MethodType(forward, block)
    block.moecc_layer = layer
