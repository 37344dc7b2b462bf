"""Host-resident storage of the routed experts' frozen weights: one copy, in host memory, never moved.

The fused Hugging Face parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) stay where they are
in the module tree, so the model still saves and prints as usual, but they live in host memory and the experts
subtree (with its LoRA factors) refuses device moves: ``Trainer`` and ``accelerate`` call ``model.to(device)``
and must not drag the experts to the GPU.

Experts held in a quantized format (``moecc.experts.formats``) keep their ``QuantizedMatrices`` on the experts
module (attribute ``moecc_quantized``: parameter name -> matrices, in the kernels' orientation ``[E, N out, K in]``
whatever the model's layout), and the parameters become placeholders: the same shape and dtype, one element of
storage repeated by zero strides, so PEFT's set-up, shape reads and printing work while the quantized copy is the
only one in host memory.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from .errors import MoeccError, UnsupportedDtypeError, UnsupportedModelError
from .experts.formats import QuantizedMatrices, check_format, dequantize, quantize
from .experts.types import ExpertWeights

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
QUANTIZED = "moecc_quantized"  # experts module attribute: {parameter name: QuantizedMatrices}
# Experts quantized at a time: the float32 temporaries of quantizing stay near this many bytes.
_CHUNK_BYTES = 1 << 25

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


def placeholder(shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zero of ``dtype`` seen as a tensor of ``shape`` through zero strides: stands in for weights held
    quantized, holding no storage of its own beyond one element."""
    return torch.zeros((), dtype=dtype).expand(shape)


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a :func:`placeholder` (or holds no more storage than one)."""
    return tensor.untyped_storage().nbytes() <= tensor.element_size() and tensor.numel() > 1


def quantized_matrices(experts: torch.nn.Module) -> dict[str, QuantizedMatrices]:
    """The experts' weights held quantized, by parameter name (empty when they are plain tensors)."""
    return getattr(experts, QUANTIZED, None) or {}


def expert_format(experts: torch.nn.Module) -> str:
    """The format the experts' frozen weights are held in: a quantized format, else the dtype's name."""
    held = quantized_matrices(experts)
    if held:
        return next(iter(held.values())).format
    return str(experts.gate_up_proj.dtype).removeprefix("torch.")


def kernel_view(experts: torch.nn.Module, weights: torch.Tensor) -> torch.Tensor:
    """The experts' ``weights`` (either projection) in the kernels' orientation ``[E, N out, K in]`` (a view)."""
    return weights.transpose(1, 2) if getattr(experts, "is_transposed", False) else weights


def kernel_shape(experts: torch.nn.Module, shape: torch.Size | tuple) -> tuple[int, int, int]:
    """``(E, N, K)`` of a projection whose parameter has ``shape`` in the model's layout."""
    e, a, b = shape
    return (e, b, a) if getattr(experts, "is_transposed", False) else (e, a, b)


def hold_quantized(experts: torch.nn.Module, name: str, matrices: QuantizedMatrices, dtype: torch.dtype) -> None:
    """Keeps ``matrices`` as the experts' ``name`` weights; the parameter becomes a placeholder of its shape and
    ``dtype``, so its old storage is released once nothing else holds it."""
    param = experts._parameters[name]
    shape = param.shape
    expected = kernel_shape(experts, shape)
    if tuple(matrices.shape) != expected:
        raise MoeccError(f"{name}: quantized matrices of shape {tuple(matrices.shape)} for weights {tuple(shape)} "
                         f"(expected {expected} in the kernels' [E, N, K] orientation)")
    stand_in = placeholder(shape, dtype)
    if param.device.type == "cpu" and param.dtype == dtype:
        param.data = stand_in  # the same Parameter object: references to it stay valid
    else:
        experts._parameters[name] = torch.nn.Parameter(stand_in, requires_grad=False)
    if not quantized_matrices(experts):
        experts.register_load_state_dict_pre_hook(_refuse_loading_quantized)
    object.__setattr__(experts, QUANTIZED, {**quantized_matrices(experts), name: matrices})


def _refuse_loading_quantized(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` hook: values for weights held quantized have nowhere to go (their parameters are
    placeholders), so a state dict that holds them is refused before anything is copied."""
    given = [prefix + name for name in quantized_matrices(module) if prefix + name in state_dict]
    if given:
        format = next(iter(quantized_matrices(module).values())).format
        raise MoeccError(f"cannot load {given[0]}: moecc holds these experts' frozen weights in {format} and their "
                         "parameters are placeholders. Load only the adapter's tensors (strict=False, or "
                         "set_peft_model_state_dict), or load the weights into the model before moecc.prepare")


def expert_chunks(shape: tuple[int, int, int]):
    """Slices of a few experts each, whose float32 ``[n, N, K]`` temporaries stay near ``_CHUNK_BYTES``."""
    e, n, k = shape
    step = max(1, _CHUNK_BYTES // (4 * n * k))
    return [slice(start, min(start + step, e)) for start in range(0, e, step)]


def stacked_shape(parts: list[QuantizedMatrices]) -> tuple[int, int, int]:
    """``(E, N, K)`` of matrices stacked along N."""
    return parts[0].shape[0], sum(q.shape[1] for q in parts), parts[0].shape[2]


def convert(source: torch.Tensor | list[QuantizedMatrices], format: str, group: int | None = None) -> QuantizedMatrices:
    """``source [E, N, K]`` in ``format``: float weights, or matrices stacked along N (another format's, taken at
    their bf16 values). Quantized a few experts at a time: each expert's scales are its own, so the result is the
    one :func:`moecc.experts.formats.quantize` gives at once, with temporaries a few times a chunk's size."""
    if isinstance(source, torch.Tensor):
        shape = tuple(source.shape)
        chunk: Callable[[slice], torch.Tensor] = lambda part: source[part].contiguous()
    else:
        shape = stacked_shape(source)
        chunk = lambda part: torch.cat([dequantize(q.experts(part)) for q in source], dim=1)
    data = scales = None
    for part in expert_chunks(shape):
        q = quantize(chunk(part), format, group)
        if data is None:
            data = torch.empty((shape[0], *q.data.shape[1:]), dtype=q.data.dtype)
            scales = torch.empty((shape[0], *q.scales.shape[1:]), dtype=q.scales.dtype)
        data[part], scales[part] = q.data, q.scales
        group = q.group
    return QuantizedMatrices(format, data, scales, shape, group)


def dequantize_into(out: torch.Tensor, parts: list[QuantizedMatrices]) -> None:
    """Writes the bf16 values of ``parts`` (stacked along N) into ``out [E, N, K]`` (a view of a parameter, in its
    dtype), a few experts at a time."""
    row = 0
    for q in parts:
        for part in expert_chunks(q.shape):
            out[part, row:row + q.shape[1]] = dequantize(q.experts(part))
        row += q.shape[1]


def quantize_experts(experts: torch.nn.Module, format: str, group: int | None = None) -> None:
    """Holds the experts' frozen weights in ``format`` (see :func:`hold_quantized`), one projection at a time, so
    host memory holds one projection's float weights beside the quantized copies."""
    for name in EXPERT_PARAMETERS:
        weights = experts._parameters[name]
        matrices = convert(kernel_view(experts, weights.data), format, group)
        hold_quantized(experts, name, matrices, weights.dtype)


def return_freed_memory() -> None:
    """Hands host memory freed by converting experts back to the system: glibc keeps freed blocks below its mmap
    threshold (32 MB chunks and smaller) in its heap, still counted in the process's resident size. Nothing to do
    elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def expert_weights(experts: torch.nn.Module) -> ExpertWeights:
    """Views of a Hugging Face fused experts module's weights, with the layout flags its class declares (and the
    quantized matrices, where it holds them)."""
    bias = getattr(experts, "has_bias", False)
    clamped = hasattr(experts, "limit") and hasattr(experts, "alpha")  # gpt-oss's clamped SwiGLU
    held = quantized_matrices(experts)
    return ExpertWeights(
        gate_up=experts.gate_up_proj.data,
        down=experts.down_proj.data,
        gate_up_bias=experts.gate_up_proj_bias.data if bias else None,
        down_bias=experts.down_proj_bias.data if bias else None,
        transposed=getattr(experts, "is_transposed", False),
        interleaved=not getattr(experts, "is_concatenated", True),
        swiglu_alpha=float(experts.alpha) if clamped else None,
        swiglu_limit=float(experts.limit) if clamped else None,
        gate_up_q=held.get("gate_up_proj"),
        down_q=held.get("down_proj"),
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
                f"{layer_name}.{name} is {tensor.dtype}; moecc runs experts in bfloat16, float16 or float32, or "
                "holds them quantized itself. Load the model with dtype=torch.bfloat16, or an FP8 / MXFP4 "
                "checkpoint with moecc.from_pretrained(path), which reads it"
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
    _check_quantized(experts, layer_name)
    for _, tensor in tensors:
        tensor.requires_grad_(False)


def _check_quantized(experts: torch.nn.Module, layer_name: str) -> None:
    """Experts held quantized hold both projections, in one format, shaped as their placeholders."""
    held = quantized_matrices(experts)
    if not held:
        return
    formats = {name: q.format for name, q in held.items()}
    if set(held) != set(EXPERT_PARAMETERS) or len(set(formats.values())) != 1:
        raise UnsupportedModelError(f"{layer_name}: the experts hold {formats} quantized; both projections must be "
                                    f"held in one format ({', '.join(EXPERT_PARAMETERS)})")
    for name, q in held.items():
        param = experts._parameters[name]
        if tuple(q.shape) != kernel_shape(experts, param.shape):
            raise UnsupportedModelError(f"{layer_name}.{name}: quantized matrices of shape {tuple(q.shape)} beside a "
                                        f"parameter of shape {tuple(param.shape)}; load the model again")
        if not is_placeholder(param):
            raise UnsupportedModelError(f"{layer_name}.{name} holds values again beside its quantized copy (the "
                                        "parameter was replaced after moecc quantized it); load the model again")


def target_format(experts: torch.nn.Module, layer_name: str, requested: str, group: int) -> str | None:
    """The quantized format ``moecc.prepare`` converts one layer's experts to under ``expert_format=requested``
    (None: they stay as they are), or an error naming what cannot be done, the value seen and the fix."""
    dtype = experts._parameters["gate_up_proj"].dtype
    dtype_name = str(dtype).removeprefix("torch.")
    if quantized_matrices(experts):
        held = expert_format(experts)
        if requested not in ("auto", held):
            raise MoeccError(
                f"{layer_name}: the experts are held in {held}, as the checkpoint was read, and "
                f"expert_format={requested!r} asks for another format; pass expert_format to moecc.from_pretrained, "
                "which converts them while it loads, or use 'auto'")
        if dtype != torch.bfloat16:
            raise UnsupportedDtypeError(f"{layer_name}: {held} experts compute in bfloat16, but the model is "
                                        f"{dtype_name}; load it with dtype=torch.bfloat16")
        return None
    if requested == "auto":
        return None
    if dtype != torch.bfloat16:
        wanted = "bfloat16 experts" if requested == "bf16" else f"{requested} experts, quantized from bfloat16"
        raise UnsupportedDtypeError(
            f"expert_format={requested!r} asks for {wanted}, but {layer_name}'s experts are {dtype_name}: load the "
            f"model in bfloat16 (dtype=torch.bfloat16), or use expert_format='auto' to keep {dtype_name} experts")
    if requested == "bf16":
        return None
    for name in EXPERT_PARAMETERS:
        _, _, k = kernel_shape(experts, experts._parameters[name].shape)
        try:
            check_format(requested, k, group if requested == "int4" else None)
        except MoeccError as error:
            where = " (MoeccConfig(int4_group_size=...) or MOECC_INT4_GROUP)" if requested == "int4" else ""
            raise MoeccError(f"{layer_name}.experts.{name}: {error}{where}") from None
    return requested
