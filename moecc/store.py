"""Host-resident storage of the routed experts' frozen weights: one copy, in host memory, never moved.

The fused Hugging Face parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) stay where they are
in the module tree, so the model still saves and prints as usual, but they live in host memory and the experts
subtree (with its LoRA factors) refuses device moves: ``Trainer`` and ``accelerate`` call ``model.to(device)``
and must not drag the experts to the GPU.
"""
from __future__ import annotations

import torch

from .errors import UnsupportedDtypeError, UnsupportedModelError
from .experts.types import ExpertWeights

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_HOST_RESIDENT_CLASSES: dict[type, type] = {}


def _host_resident_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``_apply`` (behind ``.to()``, ``.cuda()``, ``.half()``) leaves it as it is."""
    if cls not in _HOST_RESIDENT_CLASSES:

        def _apply(self, fn, recurse: bool = True):
            return self

        # Same name as the original: PEFT recognises its wrappers by class name.
        _HOST_RESIDENT_CLASSES[cls] = type(cls.__name__, (cls,), {"_apply": _apply, "__module__": cls.__module__})
    return _HOST_RESIDENT_CLASSES[cls]


def keep_on_host(module: torch.nn.Module) -> None:
    """Moves ``module`` (and its subtree) to host memory and keeps it there through later device moves.

    Dtype casts of the whole model (``model.half()``) skip it too: expert weights keep their dtype and the
    expert LoRA factors stay float32 masters.
    """
    module.to("cpu")
    module.__class__ = _host_resident_class(type(module))


def expert_weights(experts: torch.nn.Module) -> ExpertWeights:
    """Views of a Hugging Face fused experts module's weights, with the layout flags its class declares."""
    bias = getattr(experts, "has_bias", False)
    clamped = hasattr(experts, "limit") and hasattr(experts, "alpha")  # gpt-oss's clamped SwiGLU
    return ExpertWeights(
        gate_up=experts.gate_up_proj.data,
        down=experts.down_proj.data,
        gate_up_bias=experts.gate_up_proj_bias.data if bias else None,
        down_bias=experts.down_proj_bias.data if bias else None,
        transposed=getattr(experts, "is_transposed", False),
        interleaved=not getattr(experts, "is_concatenated", True),
        swiglu_alpha=float(experts.alpha) if clamped else None,
        swiglu_limit=float(experts.limit) if clamped else None,
    )


def check_host_experts(experts: torch.nn.Module, layer_name: str) -> None:
    """Checks a fused experts module's weights (host memory, dtype, shapes) and freezes them."""
    weights = expert_weights(experts)
    gate_up, down = weights.gate_up, weights.down
    tensors = [("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)]
    if weights.gate_up_bias is not None:
        tensors += [("gate_up_proj_bias", experts.gate_up_proj_bias), ("down_proj_bias", experts.down_proj_bias)]
    for name, tensor in tensors:
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"{layer_name}.{name} is {tensor.dtype}; moecc runs experts in bfloat16, float16 or float32. "
                "Load the model with dtype=torch.bfloat16 (dequantize FP8/MXFP4 checkpoints first)"
            )
        if tensor.device.type != "cpu":
            raise UnsupportedModelError(
                f"{layer_name}.{name} is on {tensor.device} after moving experts to host memory; something "
                "re-placed it (a device_map or hook?). Load the model without device_map"
            )
    expected = "[E, H, 2I] and [E, I, H]" if weights.transposed else "[E, 2I, H] and [E, H, I]"
    inner = (gate_up.shape[2], down.shape[1]) if weights.transposed else (gate_up.shape[1], down.shape[2])
    if gate_up.dim() != 3 or down.dim() != 3 or inner[0] != 2 * inner[1]:
        raise UnsupportedModelError(
            f"{layer_name}: expected fused gate_up_proj and down_proj of shapes {expected}, got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    for _, tensor in tensors:
        tensor.requires_grad_(False)
