"""What every MoE family adapter provides, and the sparse-block forward they all share.

A family adapter knows its sparse block class, how to route (router module → top-k ids and weights), and how
to compute its shared experts. The shared forward below queues the routed tokens to the CPU first, then the
shared experts on the device, so the two overlap, and adds the results.
"""
from __future__ import annotations

import importlib
import types

import torch


class MoeFamily:
    """Base adapter; subclasses set the class attributes and override ``shared_output`` if needed."""

    model_type: str = ""
    modeling_module: str = ""  # transformers.models.<x>.modeling_<x>
    block_class_name: str = ""
    attention_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def block_class(self) -> type:
        module = importlib.import_module(self.modeling_module)
        return getattr(module, self.block_class_name)

    def check_config(self, config) -> None:
        """Raises UnsupportedModelError for settings the engine cannot run (e.g. another activation)."""
        from ..errors import UnsupportedModelError

        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"{self.model_type} with hidden_act={act!r}: moecc's expert kernels implement SwiGLU (silu) only"
            )

    def route(self, block: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_k_weights [T, k], top_k_index [T, k])`` from the block's own router module."""
        _, top_k_weights, top_k_index = block.gate(hidden)
        return top_k_weights, top_k_index

    def shared_output(self, block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """Output of the shared experts on ``hidden [T, H]``, or None for families without them."""
        return None


def install_block_forward(block: torch.nn.Module, family: MoeFamily, layer) -> None:
    """Replaces ``block.forward`` with one that sends routed experts to ``layer`` (a paradigm layer)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])  # [T, H]
        top_k_weights, top_k_index = family.route(self, hidden)  # [T, k], [T, k]
        staged = layer.stage_in(hidden, top_k_index, top_k_weights)
        shared = family.shared_output(self, hidden)  # queued on the device while the CPU works
        routed = layer.run(hidden, top_k_weights, staged)  # [T, H]
        out = routed if shared is None else routed + shared
        return out.view(shape)

    block.forward = types.MethodType(forward, block)
    block.moecc_layer = layer
