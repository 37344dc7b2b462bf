"""Host-resident storage of the routed experts' frozen weights: one copy, in host memory, never moved.

The fused Hugging Face parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) stay where they are
in the module tree, so the model still saves and prints as usual, but they live in host memory and the experts
subtree (with its LoRA factors) refuses device moves: ``Trainer`` and ``accelerate`` call ``model.to(device)``
and must not drag the experts to the GPU.
"""
from __future__ import annotations

import torch

from .errors import UnsupportedDtypeError
from .reference import ExpertWeights

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _StayOnHost:
    """Replaces ``nn.Module._apply`` on a subtree: ``.to()``, ``.cuda()``, ``.half()`` leave it untouched."""

    def __call__(self, fn, recurse: bool = True) -> None:
        return None


def keep_on_host(module: torch.nn.Module) -> None:
    """Moves ``module`` (and its subtree) to host memory and pins it there against later device moves."""
    module.to("cpu")
    module._apply = _StayOnHost()


def is_kept_on_host(module: torch.nn.Module) -> bool:
    """Whether :func:`keep_on_host` was applied to ``module``."""
    return isinstance(module.__dict__.get("_apply"), _StayOnHost)


def host_expert_weights(experts: torch.nn.Module, layer_name: str) -> ExpertWeights:
    """Checks a fused experts module's weights and returns host views of them (no copy)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    for name, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"{layer_name}.{name} is {tensor.dtype}; moecc runs experts in bfloat16, float16 or float32. "
                "Load the model with torch_dtype=torch.bfloat16 (dequantize FP8/MXFP4 checkpoints first)"
            )
        if tensor.device.type != "cpu":
            raise RuntimeError(f"{layer_name}.{name} must be in host memory before the engine uses it")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        raise UnsupportedDtypeError(
            f"{layer_name}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    gate_up.requires_grad_(False)
    down.requires_grad_(False)
    return ExpertWeights(gate_up=gate_up.data.contiguous(), down=down.data.contiguous())
