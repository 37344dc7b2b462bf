"""What ``moecc.prepare`` built, in words: one log line (logger ``moecc``) per prepared model.

The line names the paradigm, the expert backend (and kernel ISA) of each kind of MoE layer, the pool's threads
and the GPU budget. A layer that runs on the plain-PyTorch reference backend on the CPU (float32 / float16 weights,
gpt-oss-style experts, or ``backend="reference"``) gets a warning with the reason and how to get the kernels.
"""
from __future__ import annotations

import logging

from . import _ops
from .experts import reference
from .experts.native import NativeExperts
from .experts.select import PerLayerExperts

logger = logging.getLogger("moecc")


def layer_kind(weights) -> str:
    """A short name for a layer's expert weights: their format (dtype or quantized format, ``int4/128`` with its
    group), plus ``gpt-oss-style`` for that layout."""
    kind = weights.format
    if weights.gate_up_q is not None and weights.gate_up_q.format == "int4":
        kind = f"int4/{weights.gate_up_q.group}"
    special = weights.transposed or weights.interleaved or weights.gate_up_bias is not None
    return f"{kind} gpt-oss-style" if special else kind


def _reference_reason(weights, chosen: bool) -> str:
    if chosen:
        return "MoeccConfig.backend='reference' (MOECC_BACKEND) was asked for"
    if weights.gate_up_q is not None:
        return f"the kernels do not run {weights.format} experts of this layout"
    if weights.gate_up.dtype.is_floating_point and str(weights.gate_up.dtype) != "torch.bfloat16":
        return f"the expert weights are {str(weights.gate_up.dtype).removeprefix('torch.')}; the kernels run bfloat16"
    return "the kernels run SwiGLU experts in the standard layout, not gpt-oss-style ones (biases, clamped SwiGLU)"


def cpu_backend_name(backend, weights) -> tuple[str, str | None]:
    """``(what runs the layer on the CPU, why it is the reference or None)``."""
    chosen = backend is reference
    if isinstance(backend, PerLayerExperts):
        backend = backend.native if backend.native.supports(weights) else reference
    if isinstance(backend, NativeExperts):
        return f"native ({backend.isa})", None
    return "reference", _reference_reason(weights, chosen)


def describe(state, config) -> tuple[str, list[str]]:
    """``(the summary line, warnings)`` for a prepared model's ``model.moecc`` state."""
    engine = state.engine
    described = engine.describe()
    cpu, device_math = described.cpu, described.device_math
    kinds: dict[str, list] = {}
    for layer in state.layers:
        weights = layer.weights
        kinds.setdefault(layer_kind(weights), []).append(weights)
    parts, warnings = [], []
    for kind, layers in kinds.items():
        sides = []
        if cpu is not None:
            name, why = cpu_backend_name(cpu, layers[0])
            sides.append(f"CPU {name}")
            if why:
                warnings.append(
                    f"{len(layers)} MoE layer(s) with {kind} experts run on the reference backend on the CPU "
                    f"(plain PyTorch, several times slower than the kernels): {why}. For the native kernels, load "
                    "the model in bfloat16 (moecc.from_pretrained(path, dtype=torch.bfloat16), or transformers' "
                    "from_pretrained(..., dtype=torch.bfloat16)) and leave MOECC_BACKEND unset")
        if device_math is not None:
            sides.append(f"{engine.device.type} {device_math}")
        parts.append(f"{len(layers)} x {kind}: {' + '.join(sides)}")
    parts += described.notes
    slots = described.cache
    if slots is not None and slots.cache_sizer is not None:
        parts.append("expert cache: what the GPU budget (or free memory) leaves at each batch size"
                     if slots.cache_sizer.limit_bytes else "expert cache: none (host and device are one memory)")
    elif slots is not None and slots.cache is not None:
        parts.append(f"expert cache {slots.cache.budget_bytes / 1e9:g} GB")
    budget = config.gpu_memory_budget_gb
    line = (f"moecc prepared {state.family.model_type}: paradigm={state.paradigm}, device={state.device}, "
            f"experts: {'; '.join(parts)}, threads={_ops.num_threads()}"
            f"{' (pinned)' if config.pin_threads else ''}, gpu budget="
            f"{'none' if budget is None else f'{budget:g} GB'}")
    return line, warnings


def log_prepared(state, config) -> None:
    """Logs :func:`describe`'s line (INFO) and warnings (WARNING) on logger ``moecc``."""
    line, warnings = describe(state, config)
    logger.info(line)
    for warning in warnings:
        logger.warning(warning)
