"""The backend a paradigm runs, from the names ``MoeccConfig`` holds (``backend``, ``offload_compute``)."""
from __future__ import annotations

import torch

from .. import _ops
from ..errors import MoeccError
from . import grouped, reference
from .native import NativeExperts
from .types import ExpertBackend, ExpertWeights, LoraGrads, SavedState

# Device-side math: the modules are the backends (no state).
DEVICE_BACKENDS: dict[str, ExpertBackend] = {"grouped": grouped, "reference": reference}


class PerLayerExperts:
    """``backend="auto"``: the native kernels on the layers they run, the reference on the rest (float32 /
    float16 models, gpt-oss-style experts)."""

    def __init__(self, native: NativeExperts) -> None:
        self.native = native

    def _backend(self, weights: ExpertWeights) -> ExpertBackend:
        return self.native if self.native.supports(weights) else reference

    def supports(self, weights: ExpertWeights) -> bool:
        return True

    def forward(self, weights: ExpertWeights, *args, **kwargs) -> tuple[torch.Tensor, SavedState]:
        return self._backend(weights).forward(weights, *args, **kwargs)

    def backward(self, weights: ExpertWeights, *args) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
        return self._backend(weights).backward(weights, *args)

    def forward_pairs(self, weights: ExpertWeights, *args, **kwargs) -> tuple:
        """``NativeExperts.forward_pairs`` on the layers it runs; the reference's dense output (no rows) else."""
        if self.native.supports(weights):
            return self.native.forward_pairs(weights, *args, **kwargs)
        out, saved = reference.forward(weights, *args, **kwargs)
        return out, None, saved

    def backward_pairs(self, weights: ExpertWeights, *args) -> tuple:
        """The backward of :meth:`forward_pairs` (``(grad_hidden or rows, tokens or None, grad_weights, grads)``)."""
        if self.native.supports(weights):
            return self.native.backward_pairs(weights, *args)
        grad_hidden, grad_weights, grads = reference.backward(weights, *args)
        return grad_hidden, None, grad_weights, grads

    def forward_pairs_into(self, weights: ExpertWeights, *args, **kwargs) -> SavedState:
        """``NativeExperts.forward_pairs_into``: only where :meth:`forward_pairs` returns rows (``returns_rows``)."""
        return self.native.forward_pairs_into(weights, *args, **kwargs)

    def backward_pairs_into(self, weights: ExpertWeights, *args, **kwargs) -> None:
        """``NativeExperts.backward_pairs_into``: only for a :meth:`forward_pairs` that returned rows, which only
        the native kernels do (``returns_rows``)."""
        self.native.backward_pairs_into(weights, *args, **kwargs)

    def returns_rows(self, weights: ExpertWeights) -> bool:
        """Whether :meth:`forward_pairs` can return rows per pair for this layer (only the native kernels do)."""
        return self.native.supports(weights)

    def keep_experts(self, weights: ExpertWeights, saved: SavedState, experts) -> SavedState:
        """``saved`` with only ``experts``' pairs, from the backend that made it."""
        backend = self.native if self.native.supports(weights) else reference
        return backend.keep_experts(weights, saved, experts)

    def release_result(self, tensor: torch.Tensor) -> None:
        self.native.release_result(tensor)

    def release(self, saved: SavedState) -> None:
        """``NativeExperts.release``: the native kernels' buffers go back to their pool (others are ignored)."""
        self.native.release(saved)

    @property
    def fresh_bytes(self) -> int:
        """The native kernels' new buffer bytes (the reference keeps no pools)."""
        return self.native.fresh_bytes

    def prepare_layers(self, weights: list[ExpertWeights]) -> None:
        self.native.prepare_layers(weights)


def cpu_backend(name: str, isa: str = "auto", prepack: bool = False) -> ExpertBackend:
    """Co-compute's host-side math: ``"reference"``, ``"native"`` (``isa``, ``prepack``: see ``MoeccConfig``) or
    ``"auto"``."""
    if name == "reference":
        return reference
    if name not in ("native", "auto"):
        raise ValueError(f"unknown CPU expert backend {name!r}; use 'auto', 'native' or 'reference'")
    native = NativeExperts(_ops.best_isa() if isa == "auto" else isa, prepack=prepack)
    return native if name == "native" else PerLayerExperts(native)


def device_backend(name: str, source: str = "offload_compute") -> ExpertBackend:
    """The device-side math called ``name``; an error naming ``source`` (where the name came from) otherwise."""
    if name not in DEVICE_BACKENDS:
        raise MoeccError(
            f"{source}={name!r} is not an offload expert computation; use 'grouped' (grouped matrix products, "
            "LoRA factorised, agrees with HF + PEFT to the dtype's rounding) or 'reference' (bit-exact with "
            "HF + PEFT, one expert at a time)"
        )
    return DEVICE_BACKENDS[name]


def default_device_backend(device: torch.device) -> str:
    """``offload_compute="auto"``: grouped products on CUDA, the exact reference elsewhere (CPU runs stay exact)."""
    return "grouped" if device.type == "cuda" else "reference"
