"""The gated activations of routed experts and their gradients, rounded where the original rounds them.

Shared by every backend that computes in PyTorch (the reference, the grouped products), so both apply the
activation exactly as Hugging Face's experts do: SwiGLU ``silu(gate) * up`` or gpt-oss's clamped variant.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import ExpertWeights


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds float32 ``x`` to ``dtype`` and back (the identity for float32)."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def split(gu: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate [n, I], up [n, I])`` views of the pre-activations ``[n, 2I]``."""
    if interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    half = gu.shape[1] // 2
    return gu[:, :half], gu[:, half:]


def merge(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of :func:`split`: ``[n, 2I]`` in the weights' gate/up layout."""
    if interleaved:
        return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1)
    return torch.cat([gate, up], dim=1)


def _final(x: torch.Tensor, dtype: torch.dtype, as_dtype: bool) -> torch.Tensor:
    """The last rounding of a result: ``x`` in ``dtype`` itself where the caller takes it so, else rounded float32
    (a float copy the caller would convert back costs one more op on the thread that queues the device's)."""
    return x.to(dtype) if as_dtype else round_to(x, dtype)


def activate(gate: torch.Tensor, up: torch.Tensor, weights: ExpertWeights, dtype: torch.dtype,
             as_dtype: bool = False) -> torch.Tensor:
    """The gated activation, rounded after every elementwise step as the original computes it; in ``dtype`` with
    ``as_dtype``, else float32."""
    if weights.swiglu_limit is None:
        return _final(round_to(F.silu(gate), dtype) * up, dtype, as_dtype)
    limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = round_to(gate * round_to(torch.sigmoid(round_to(gate * alpha, dtype)), dtype), dtype)
    return _final(round_to(up + 1, dtype) * glu, dtype, as_dtype)


def activation_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: ExpertWeights,
                     dtype: torch.dtype, as_dtype: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of :func:`activate`, rounded where autograd of the rounded pipeline rounds; in ``dtype``
    with ``as_dtype``, else float32."""
    if weights.swiglu_limit is None:
        silu = round_to(F.silu(gate), dtype)
        sig = torch.sigmoid(gate)
        grad_gate = _final(round_to(grad * up, dtype) * sig * (1 + gate * (1 - sig)), dtype, as_dtype)
        return grad_gate, _final(grad * silu, dtype, as_dtype)
    limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
    gate_c = gate.clamp(max=limit)
    up_c = up.clamp(min=-limit, max=limit)
    sig = round_to(torch.sigmoid(round_to(gate_c * alpha, dtype)), dtype)
    glu = round_to(gate_c * sig, dtype)
    grad_up = round_to(grad * glu, dtype) * ((up >= -limit) & (up <= limit))
    grad_glu = round_to(grad * round_to(up_c + 1, dtype), dtype)
    grad_t = round_to(round_to(grad_glu * gate_c, dtype) * sig * (1 - sig), dtype)
    grad_gate_c = round_to(round_to(grad_glu * sig, dtype) + round_to(grad_t * alpha, dtype), dtype)
    return _final(grad_gate_c * (gate <= limit), dtype, as_dtype), _final(grad_up, dtype, as_dtype)
