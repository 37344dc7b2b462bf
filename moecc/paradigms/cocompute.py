"""Co-compute paradigm: routed experts run on the CPU, in place on host-resident weights.

Per MoE layer, forward: routed activations go device→host (async, side stream), the CPU computes the experts
with their LoRA, the output goes host→device. Backward mirrors it. One ``torch.autograd.Function`` carries the
gradients of the hidden states, of the top-k routing weights (so the router, and every LoRA before it, gets
the right gradient) and of every expert LoRA factor, which live and are updated in host memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from .. import reference
from ..lora import expert_lora
from ..reference import ExpertLora, ExpertWeights
from ..staging import HostCopy, StagingBuffers


@dataclass
class StepMetrics:
    """Counters accumulated since the last ``reset``; read by benchmarks and the Trainer callback."""

    cpu_forward_s: float = 0.0
    cpu_backward_s: float = 0.0
    tokens_routed: int = 0
    expert_token_counts: list = field(default_factory=list)

    def reset(self) -> None:
        self.cpu_forward_s = self.cpu_backward_s = 0.0
        self.tokens_routed = 0
        self.expert_token_counts = []


class CoComputeEngine:
    """Shared state of every co-compute layer: staging buffers, the CPU backend, metrics."""

    def __init__(self, device: torch.device, backend: str = "reference") -> None:
        if backend != "reference":
            raise ValueError(f"unknown co-compute backend {backend!r}")
        self.device = device
        self.staging = StagingBuffers(device)
        self.forward_fn = reference.experts_forward
        self.backward_fn = reference.experts_backward
        self.metrics = StepMetrics()


class CoComputeLayer:
    """One MoE layer's routed experts on the CPU, with the PEFT wrappers that hold their LoRA."""

    def __init__(self, name: str, weights: ExpertWeights, wrappers: dict, adapter_name: str,
                 engine: CoComputeEngine) -> None:
        self.name = name
        self.weights = weights
        self.wrappers = wrappers
        self.adapter_name = adapter_name
        self.engine = engine

    def lora(self) -> tuple[ExpertLora | None, ExpertLora | None]:
        """Current (gate_up, down) LoRA factors, or None where a projection has no adapter."""
        return (expert_lora(self.wrappers.get("gate_up_proj"), self.adapter_name),
                expert_lora(self.wrappers.get("down_proj"), self.adapter_name))

    def stage_in(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> HostCopy:
        """Starts the device→host copy of one layer's routed inputs; call before queueing shared-expert work."""
        return self.engine.staging.to_host({
            "hidden": hidden.detach().contiguous(),
            "top_k_index": top_k_index.contiguous(),
            "top_k_weights": top_k_weights.detach().contiguous(),
        })

    def run(self, hidden: torch.Tensor, top_k_weights: torch.Tensor, staged: HostCopy) -> torch.Tensor:
        """Routed-expert output ``[T, H]`` on the device, differentiable in hidden, weights and expert LoRA."""
        gate_up, down = self.lora()
        factors = [t for lora in (gate_up, down) for t in ((lora.A, lora.B) if lora else (None, None))]
        return CpuExpertsFunction.apply(hidden, top_k_weights, staged, self, gate_up, down, *factors)


class CpuExpertsFunction(torch.autograd.Function):
    """Autograd node of one layer's CPU experts; LoRA A/B tensors are inputs so they receive gradients."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, staged, layer, gate_up_lora, down_lora, *lora_tensors):
        engine = layer.engine
        views = staged.wait()
        start = time.perf_counter()
        with record_function("moecc.cpu_experts.forward"):
            out, saved = engine.forward_fn(layer.weights, views["hidden"], views["top_k_index"],
                                           views["top_k_weights"], gate_up_lora, down_lora)
        engine.metrics.cpu_forward_s += time.perf_counter() - start
        engine.metrics.tokens_routed += views["top_k_index"].numel()
        engine.metrics.expert_token_counts.append((saved.offsets[1:] - saved.offsets[:-1]).tolist())
        ctx.layer, ctx.saved, ctx.lora = layer, saved, (gate_up_lora, down_lora)
        ctx.hidden_dtype, ctx.weights_dtype = hidden.dtype, top_k_weights.dtype
        with record_function("moecc.cpu_experts.to_device"):
            return engine.staging.to_device("out", _into_buffer(engine.staging, "out", out))

    @staticmethod
    def backward(ctx, grad_out):
        engine = ctx.layer.engine
        views = engine.staging.to_host({"grad_out": grad_out.contiguous()}).wait()
        start = time.perf_counter()
        with record_function("moecc.cpu_experts.backward"):
            grad_hidden, grad_weights, lora_grads = engine.backward_fn(ctx.layer.weights, ctx.saved,
                                                                       views["grad_out"], *ctx.lora)
        engine.metrics.cpu_backward_s += time.perf_counter() - start
        ctx.saved = None  # release host activations as soon as they are used
        staging = engine.staging
        grad_hidden = staging.to_device("grad_hidden", _into_buffer(staging, "grad_hidden",
                                                                    grad_hidden.to(ctx.hidden_dtype)))
        grad_weights = staging.to_device("grad_weights", _into_buffer(staging, "grad_weights",
                                                                      grad_weights.to(ctx.weights_dtype)))
        gate_up, down = ctx.lora
        factor_grads = []
        for lora, grad_a, grad_b in ((gate_up, lora_grads.gate_up_A, lora_grads.gate_up_B),
                                     (down, lora_grads.down_A, lora_grads.down_B)):
            if lora is None:
                factor_grads += [None, None]
            else:
                factor_grads += [grad_a.to(lora.A.dtype), grad_b.to(lora.B.dtype)]
        return (grad_hidden, grad_weights, None, None, None, None, *factor_grads)


def _into_buffer(staging: StagingBuffers, role: str, host: torch.Tensor) -> torch.Tensor:
    """Copies a host result into the role's (pinned) staging buffer so the device copy can be asynchronous."""
    if not staging.pinned:
        return host
    buffer = staging.view(role, tuple(host.shape), host.dtype)
    buffer.copy_(host)
    return buffer
