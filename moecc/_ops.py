"""The only importer of ``moecc._C``: checks every tensor before its address crosses into C++.

C++ trusts what it is given, so dtype, device, contiguity and sizes are validated here, and every buffer the
native side writes is allocated here and owned by the returned tensors.
"""
from __future__ import annotations

import atexit
import os
import warnings

import torch

from . import _C
from .config import native_bf16_from_env


def _check_host(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be in host memory, got a tensor on {tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def group_tokens_by_expert(top_k_index: torch.Tensor, num_experts: int,
                           keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable counting sort of routed (token, slot) pairs by expert.

    Args:
        top_k_index: ``[T, k]`` expert ids in host memory (any integer dtype).
        num_experts: number of experts E; every id must lie in ``[0, E)``.
        keep: optional bool ``[E]`` in host memory: only the pairs of these experts are grouped (the others
            own empty runs).

    Returns:
        ``(offsets [E+1], order [P])`` int64: expert ``e`` owns pair ids ``order[offsets[e]:offsets[e+1]]``,
        ascending; pair ``p`` is token ``p // k``, slot ``p % k``. ``P = T*k``, or the kept experts' pairs.
    """
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [tokens, top_k], got shape {tuple(top_k_index.shape)}")
    if top_k_index.device.type != "cpu":
        raise ValueError(f"top_k_index must be in host memory, got a tensor on {top_k_index.device}")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    index = top_k_index.to(torch.int64).contiguous()
    _check_host("top_k_index", index, torch.int64)
    num_tokens, top_k = index.shape
    if keep is not None:
        if keep.device.type != "cpu" or keep.dtype != torch.bool or tuple(keep.shape) != (num_experts,):
            raise ValueError(f"keep must be a bool [{num_experts}] tensor in host memory, got {keep.dtype} "
                             f"{list(keep.shape)} on {keep.device}")
        keep = keep.contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int64)
    order = torch.empty(num_tokens * top_k, dtype=torch.int64)
    try:
        pairs = _C.group_tokens_by_expert(index.data_ptr(), num_tokens, top_k, num_experts, offsets.data_ptr(),
                                          order.data_ptr(), 0 if keep is None else keep.data_ptr())
    except IndexError as error:  # pybind11 maps std::out_of_range to IndexError
        raise ValueError(f"invalid routing: {error}") from None
    return offsets, order if keep is None else order[:pairs]


def set_num_threads(num_threads: int, pin_threads: bool = True) -> None:
    """Restart the native thread pool with ``num_threads`` threads (< 1: every CPU this process may use)."""
    _C.set_num_threads(int(num_threads), bool(pin_threads))


def configure_pool(num_threads: int | None, pin_threads: bool) -> None:
    """Makes the native pool have ``num_threads`` threads (None: every available CPU) and the given pinning,
    restarting it only when it differs."""
    wanted = num_threads or available_cpus()
    if _C.num_threads() != wanted or bool(_C.pool_pinned()) != bool(pin_threads):
        set_num_threads(wanted, pin_threads)


def num_threads() -> int:
    """Threads in the native pool, the calling thread included."""
    return int(_C.num_threads())


def available_cpus() -> int:
    """CPUs in this process's affinity mask."""
    return int(_C.available_cpus())


def pool_fill_test(n: int) -> torch.Tensor:
    """Test hook: run ``n`` pool tasks, task ``i`` writing ``2i+1``; returns the filled ``[n]`` int64 tensor."""
    out = torch.full((max(n, 0),), -1, dtype=torch.int64)
    _C.testing.pool_fill(out.data_ptr(), int(n))
    return out


def pool_raise_test(n: int, failing_task: int) -> None:
    """Test hook: run ``n`` pool tasks where ``failing_task`` throws; the error surfaces as RuntimeError."""
    _C.testing.pool_raise(int(n), int(failing_task))


atexit.register(_C.shutdown)


def _after_fork_in_child() -> None:
    # torch's OpenMP team does not survive fork: the child's first parallel op waits for threads it does not have
    # (plain torch too). One intra-op thread avoids that; moecc's own pool restarts itself (cpp/pool, pthread_atfork).
    torch.set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_native_bf16(allowed: bool) -> None:
    """Allows (or not) AVX512-BF16's bf16 rounding where the CPU has it; the kernels choose at their first call,
    so this takes effect only before any kernel has run (it runs at import, from ``MOECC_NATIVE_BF16``)."""
    _C.set_native_bf16(bool(allowed))


set_native_bf16(native_bf16_from_env())


ISAS = {"portable": 0, "avx512_bf16": 1, "amx": 2}

# The expert kernels' task shape, non-temporal stores and prefetch settings (cpp/kernels/expert_ffn.h,
# panel_gemm.h): a fresh one holds the defaults the engine runs; benchmarks and tests pass others.
KernelTuning = _C.KernelTuning
GemmTuning = _C.GemmTuning
_DEFAULT_TUNING = KernelTuning()


def cpu_features() -> dict:
    """CPU features detected at run time (cpuid, xgetbv; AMX includes the kernel's permission)."""
    return dict(_C.cpu_features())


def check_isa(isa: str) -> None:
    """Raises ValueError naming the problem when the expert kernels for ``isa`` cannot run on this CPU."""
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; choose one of {', '.join(ISAS)}")
    _C.check_isa(ISAS[isa])


def amx_self_check() -> dict:
    """Whether the AMX kernels really work in this process (cpp/kernels/amx_self_check.h): ``{"ran", "ok",
    "reason"}``. The tile configuration must read back unchanged and a small tile product must match the portable
    kernels; computed once, then cached."""
    return dict(_C.amx_self_check())


def _reset_amx_self_check(fault: int = 0) -> None:
    """Test hook: forget the self-check's result; the next check injects ``fault`` (1 readback, 2 product)."""
    global _amx_warned
    _C.testing.reset_amx_self_check(int(fault))
    _amx_warned = False


_amx_warned = False


def _runs(isa: str) -> bool:
    try:
        check_isa(isa)
        return True
    except ValueError:
        return False


def hardware_isas() -> list[str]:
    """The ISAs whose instructions this CPU and kernel offer (cpuid, XCR0, the AMX permission), before any
    self-check: the ones the kernels must be correct on here. AMX counts where its self-check could run at all."""
    return ["portable"] + ["avx512_bf16"] * _runs("avx512_bf16") + ["amx"] * amx_self_check()["ran"]


def best_isa() -> str:
    """The fastest kernel ISA that works here: amx (if its self-check passes), then avx512_bf16, then portable.
    A CPU with AMX whose self-check fails gets one warning naming the reason, and the next ISA."""
    global _amx_warned
    check = amx_self_check()
    if check["ok"]:
        return "amx"
    if check["ran"] and not _amx_warned:
        _amx_warned = True
        warnings.warn(f"this CPU has AMX but moecc's AMX self-check failed ({check['reason']}); the expert "
                      "kernels fall back to AVX512-BF16. Please report this with `moecc info`.",
                      RuntimeWarning, stacklevel=2)
    return "avx512_bf16" if _runs("avx512_bf16") else "portable"


def pack_experts(weights: torch.Tensor) -> torch.Tensor:
    """Packs bf16 expert weights ``[E, N, K]`` into the kernels' panel layout (cpp/kernels/weight_packing.h),
    element by element: the reference the vectorised per-task packers are tested against."""
    if weights.dim() != 3:
        raise ValueError(f"expert weights must be [experts, rows, cols], got shape {tuple(weights.shape)}")
    source = weights.contiguous()
    _check_host("expert weights", source, torch.bfloat16)
    experts, rows, cols = source.shape
    packed = torch.empty(experts * _C.packed_elements(rows, cols), dtype=torch.bfloat16)
    if packed.data_ptr() % 64:
        raise RuntimeError("packed expert weights must be 64-byte aligned")
    _C.pack_experts(source.data_ptr(), experts, rows, cols, packed.data_ptr())
    return packed


def pack_rows(isa: str, matrix: torch.Tensor, p0: int, p1: int) -> torch.Tensor:
    """Panels ``[p0, p1)`` of one bf16 matrix ``[N, K]`` packed by the ``isa`` variant's packer (the products
    pack their weight slices this way; tests compare it with :func:`pack_experts`)."""
    check_isa(isa)
    source = matrix.contiguous()
    _check_host("matrix", source, torch.bfloat16)
    rows, cols = source.shape
    if not 0 <= p0 <= p1 <= -(-rows // 16):
        raise ValueError(f"panels [{p0}, {p1}) out of range for {rows} rows")
    packed = torch.empty(_C.packed_elements(16 * (p1 - p0), cols), dtype=torch.bfloat16)
    _C.pack_rows(ISAS[isa], source.data_ptr(), rows, cols, p0, p1, packed.data_ptr())
    return packed


def dequantize_block_test(quantized, expert: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Test hook: rows ``[r0, r1)`` x columns ``[k0, k1)`` of expert ``expert`` of ``quantized`` (a
    ``QuantizedMatrices``) in bf16, as the product tasks dequantize the slices they pack."""
    described = _quantized_weights("quantized matrices", quantized, tuple(quantized.shape))
    (r0, r1), (k0, k1) = rows, cols
    out = torch.full((max(r1 - r0, 0), max(k1 - k0, 0)), float("nan"), dtype=torch.bfloat16)
    _C.testing.dequantize_block(described, quantized.shape[0], int(expert), int(r0), int(r1), int(k0), int(k1),
                                out.data_ptr())
    return out


def _address(tensor: torch.Tensor | None, name: str, dtype: torch.dtype, numel: int) -> int:
    """The address of a tensor the kernels read or write, after checking it is what they expect."""
    if tensor is None:  # the kernels would read through a null pointer
        raise ValueError(f"{name} is missing (None); the CPU expert kernels need it")
    _check_host(name, tensor, dtype)
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel}")
    return tensor.data_ptr()


def _lora_factors(prefix: str, lora: tuple | None, experts: int, n_in: int, n_out: int) -> _C.LoraFactors:
    """``lora`` is ``(A [E, r, in], B [out, r*E], scaling)`` float32 (PEFT's layouts) or None (no LoRA)."""
    factors = _C.LoraFactors()
    if lora is None:
        return factors
    a, b, scaling = lora
    rank = a.shape[1] if a.dim() == 3 else -1
    if a.dim() != 3 or tuple(a.shape) != (experts, rank, n_in) or tuple(b.shape) != (n_out, rank * experts):
        raise ValueError(f"{prefix} LoRA factors must be A [{experts}, r, {n_in}] and B [{n_out}, r*{experts}], "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    factors.a = _address(a, f"{prefix} LoRA A", torch.float32, experts * rank * n_in)
    factors.b = _address(b, f"{prefix} LoRA B", torch.float32, experts * n_out * rank)
    factors.rank, factors.scaling = rank, float(scaling)
    return factors


def _inner_args(lora_inner: tuple | None, gate_up_lora: tuple | None, down_lora: tuple | None,
                pairs: int) -> dict:
    """Addresses of the saved LoRA inner products ``(x A_gu [T*k, r], act A_down [T*k, r])``, float32, grouped
    order, by the field names of ``ForwardIo`` / ``BackwardIo``; either may be None (not kept, or no LoRA on that
    projection: then it must be None)."""
    args = {"inner_gate_up": 0, "inner_down": 0}
    if lora_inner is None:
        return args
    for key, inner, lora in zip(args, lora_inner, (gate_up_lora, down_lora)):
        if inner is None:
            continue
        if lora is None:
            raise ValueError(f"{key} was given for a projection without LoRA")
        args[key] = _address(inner, key, torch.float32, pairs * lora[0].shape[1])
    return args


# The quantized formats' values in the kernels (cpp/kernels/dequantize.h, WeightFormat); 0 is bf16.
WEIGHT_FORMATS = {"int8": 1, "int4": 2, "fp8": 3, "mxfp4": 4}


def _group_fits(format: str, k: int, group: int) -> bool:
    """Whether ``format`` matrices with ``k`` inputs take scale groups of ``group`` (moecc/experts/formats.py)."""
    if format == "int8":
        return group == k
    if format == "int4":
        return group in (32, 64, 128) and k % group == 0
    if format == "fp8":
        return group == 128
    return group == 32 and k % 32 == 0  # mxfp4


def _quantized_layout(format: str, shape: tuple[int, int, int], group: int) -> tuple:
    """``(codes dtype, codes shape, scales dtype, scales shape)`` of matrices ``shape`` ``(E, N, K)`` in ``format``
    with scale groups of ``group`` (moecc/experts/formats.py)."""
    e, n, k = shape
    if format == "int8":
        return torch.int8, (e, n, k), torch.float32, (e, n)
    if format == "int4":
        return torch.uint8, (e, n, k // 2), torch.float32, (e, n, k // group)
    if format == "fp8":
        return torch.uint8, (e, n, k), torch.float32, (e, -(-n // group), -(-k // group))
    return torch.uint8, (e, n, k // 2), torch.uint8, (e, n, k // group)


def _quantized_weights(name: str, quantized, shape: tuple[int, int, int]) -> _C.QuantizedWeights:
    """The kernels' description of ``quantized`` (a ``moecc.experts.formats.QuantizedMatrices``), after checking
    that it holds ``shape`` ``(E, N, K)`` in its format's layout: codes and scales in host memory, contiguous, of
    the format's dtypes and shapes, the scales aligned to their dtype."""
    format, group = quantized.format, quantized.group
    if format not in WEIGHT_FORMATS:
        raise ValueError(f"{name}: {format!r} is not a format the CPU kernels read; use one of "
                         f"{', '.join(WEIGHT_FORMATS)}")
    if tuple(quantized.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(quantized.shape)}")
    if not _group_fits(format, shape[2], group):
        raise ValueError(f"{name}: {format} matrices with K={shape[2]} take no scale group {group}")
    codes_dtype, codes_shape, scales_dtype, scales_shape = _quantized_layout(format, shape, group)
    for part, tensor, dtype, wanted in (("codes", quantized.data, codes_dtype, codes_shape),
                                        ("scales", quantized.scales, scales_dtype, scales_shape)):
        _check_host(f"{name} {part}", tensor, dtype)
        if tuple(tensor.shape) != wanted:
            raise ValueError(f"{name} {part} must be {list(wanted)}, got {list(tensor.shape)}")
    if quantized.scales.data_ptr() % quantized.scales.element_size():
        raise ValueError(f"{name} scales must be aligned to {quantized.scales.element_size()} bytes; call .clone()")
    described = _C.QuantizedWeights()
    described.format, described.group = WEIGHT_FORMATS[format], group
    described.rows, described.cols = shape[1], shape[2]
    described.data, described.scales = quantized.data.data_ptr(), quantized.scales.data_ptr()
    described.data_stride = quantized.data[0].numel() if shape[0] else 0  # bytes: the codes are 1-byte
    described.scale_stride = quantized.scales[0].numel() if shape[0] else 0
    return described


def _matrices(weights: tuple, experts: int, hidden: int, inter: int,
              packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> _C.ExpertMatrices:
    """The experts' own weights, read in place: gate_up [E, 2I, H] and down [E, H, I], each bf16 and contiguous or
    a ``QuantizedMatrices`` of that shape (moecc/experts/formats.py); and optionally the bf16 weights' copies in the
    panel layout (:func:`pack_expert_weights`)."""
    matrices = _C.ExpertMatrices()
    for name, matrix, shape in (("gate_up", weights[0], (experts, 2 * inter, hidden)),
                                ("down", weights[1], (experts, hidden, inter))):
        if not isinstance(matrix, torch.Tensor):
            if packed is not None:
                raise ValueError(f"expert {name} weights are quantized ({matrix.format}): a packed bf16 copy of them "
                                 "would hold the experts twice; pass packed=None")
            setattr(matrices, f"quantized_{name}", _quantized_weights(f"expert {name} weights", matrix, shape))
            continue
        if tuple(matrix.shape) != shape:
            raise ValueError(f"expert {name} weights must be {list(shape)}, got {list(matrix.shape)}")
        if not matrix.is_contiguous():
            raise ValueError(f"expert {name} weights must be contiguous")
        setattr(matrices, name, _address(matrix, f"expert {name} weights", torch.bfloat16, matrix.numel()))
    if packed is not None:
        matrices.packed_gate_up = _address(packed[0], "packed gate_up", torch.bfloat16,
                                           experts * _C.packed_elements(2 * inter, hidden))
        matrices.packed_down = _address(packed[1], "packed down", torch.bfloat16,
                                        experts * _C.packed_elements(hidden, inter))
    return matrices


def _routing(offsets: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, experts: int,
             pairs: int) -> _C.Routing:
    """The kernels index with these: offsets must bound a partition of [0, pairs), order be a permutation (checked
    in C++ before each kernel call, GIL released: ValueError); the routing weights float32 [pairs]."""
    routing = _C.Routing()
    routing.offsets = _address(offsets, "offsets", torch.int64, experts + 1)
    routing.order = _address(order, "order", torch.int64, pairs)
    routing.weights = _address(weights, "routing weights", torch.float32, pairs)
    return routing


def _shapes(experts: int, hidden_size: int, inter: int, tokens: int, top_k: int) -> _C.ExpertShapes:
    shapes = _C.ExpertShapes()
    shapes.experts, shapes.hidden, shapes.inter = experts, hidden_size, inter
    shapes.tokens, shapes.top_k = tokens, top_k
    return shapes


def packed_nbytes(weights: torch.Tensor) -> int:
    """Bytes of :func:`pack_expert_weights`' copy of ``[E, N, K]`` weights (N and K padded, weight_packing.h)."""
    experts, n, k = weights.shape
    return 2 * experts * _C.packed_elements(n, k)


def pack_expert_weights(isa: str, weights: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` bf16 weights in the panel layout ``isa``'s products read (weight_packing.h), each expert's
    ``packed_elements(N, K)`` values after the previous one's; a flat bf16 tensor."""
    if weights.dim() != 3:
        raise ValueError(f"expert weights to pack must be [E, N, K], got {list(weights.shape)}")
    _check_host("expert weights to pack", weights, torch.bfloat16)
    check_isa(isa)
    experts, n, k = weights.shape
    weights = weights.detach().contiguous()
    per_expert = _C.packed_elements(n, k)
    out = torch.empty(experts * per_expert, dtype=torch.bfloat16)
    panels = -(-n // 16)
    for expert in range(experts):
        _C.pack_rows(ISAS[isa], weights[expert].data_ptr(), n, k, 0, panels, out[expert * per_expert:].data_ptr())
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' bytes overlap."""
    return (a.numel() > 0 and b.numel() > 0 and a.data_ptr() < b.data_ptr() + b.nbytes
            and b.data_ptr() < a.data_ptr() + a.nbytes)


def _io_dtype(given: torch.Tensor | None, name: str) -> torch.dtype:
    """float32 or bf16, as ``given`` is (float32 when None): the dtypes the kernels read and write token rows in."""
    if given is None:
        return torch.float32
    if given.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name} must be float32 or bfloat16, got {given.dtype}")
    return given.dtype


def _output(given: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    """A new output tensor, or the caller's after checking it can take the result."""
    if given is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(given.shape) != shape or given.dtype != dtype or not given.is_contiguous() or given.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {list(shape)}, got "
                         f"{given.dtype} {list(given.shape)} on {given.device}")
    return given


def _lora_grad_outputs(given: tuple | None, gate_up_lora: tuple | None, down_lora: tuple | None,
                       grad_hidden: torch.Tensor, blocks: int | None = None) -> list:
    """Per projection ``(dA [E, r, in], dB [out, r*E])`` float32 (None without LoRA), of ``blocks`` experts
    instead of E where given: the caller's tensors where given, else new ones. A's gradient is accumulated into
    by the kernel, so it is zeroed here; B's is written whole."""
    given = (None, None) if given is None else tuple(given)
    if len(given) != 2:
        raise ValueError(f"lora_grads must be ((dA_gu, dB_gu), (dA_down, dB_down)), got {len(given)} entries")
    outputs = []
    for name, lora, pair in zip(("gate_up", "down"), (gate_up_lora, down_lora), given):
        pair = (None, None) if pair is None else tuple(pair)
        if lora is None:
            if any(grad is not None for grad in pair):
                raise ValueError(f"a {name} LoRA gradient was given for a projection without LoRA; pass None")
            outputs.append(None)
            continue
        a_shape, b_shape = tuple(lora[0].shape), tuple(lora[1].shape)
        if blocks is not None:
            a_shape, b_shape = (blocks, *a_shape[1:]), (b_shape[0], a_shape[1] * blocks)
        outputs.append((_output(pair[0], a_shape, torch.float32, f"{name} LoRA A gradient"),
                        _output(pair[1], b_shape, torch.float32, f"{name} LoRA B gradient")))
    grads = [grad for pair in outputs if pair is not None for grad in pair]
    others = [grad_hidden] + [factor for lora in (gate_up_lora, down_lora) if lora is not None for factor in lora[:2]]
    if any(_overlap(a, b) for i, a in enumerate(grads) for b in grads[i + 1:] + others):
        raise ValueError("the LoRA gradient outputs must not share memory with each other, grad_hidden or the LoRA "
                         "factors; pass separate tensors")
    for pair in outputs:
        if pair is not None:
            pair[0].zero_()
    return outputs


def _lora_grad_slots(lora_experts: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E]`` int64: the block of each of ``lora_experts`` (its position), -1 for the other experts."""
    if (lora_experts.dtype != torch.int64 or lora_experts.dim() != 1 or lora_experts.device.type != "cpu"
            or lora_experts.numel() > experts):
        raise ValueError(f"lora_experts must be a 1-D int64 CPU tensor of at most {experts} expert ids, got "
                         f"{lora_experts.dtype} {list(lora_experts.shape)} on {lora_experts.device}")
    ids = lora_experts.tolist()  # a few ids: Python, not a torch op per check
    if any(not 0 <= e < experts for e in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"lora_experts must hold distinct expert ids in [0, {experts}), got {ids}")
    slots = [-1] * experts
    for block, expert in enumerate(ids):
        slots[expert] = block
    return torch.tensor(slots, dtype=torch.int64)


def expert_ffn_forward(isa: str, weights: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int, int], top_k: int,
                       hidden: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor, routing: torch.Tensor,
                       gate_up_lora: tuple | None, down_lora: tuple | None, out: torch.Tensor | None = None,
                       gate_up_out: torch.Tensor | None = None, hidden_copy: torch.Tensor | None = None,
                       packed: tuple[torch.Tensor, torch.Tensor] | None = None,
                       lora_inner: tuple | None = None,
                       tuning: KernelTuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the CPU expert forward. ``weights = (gate_up, down)``, each bf16 or a ``QuantizedMatrices``
    (moecc/experts/formats.py, dequantized slice by slice as the products pack them); ``shape = (E, H, I)``;
    ``hidden [T, H]`` bf16; ``routing [T*k]`` float32.

    Returns ``(out [T, H], gate_up_out [T*k, 2I] bf16 in grouped order)``, written into the given tensors when
    passed (callers reuse buffers: fresh pages cost a fault each on first touch). ``out`` is float32, or bf16
    when a bf16 tensor is given (summed in float32 and rounded once, in the kernel). ``hidden_copy`` (bf16
    ``[T, H]``, optional) receives a copy of ``hidden``, made by the kernel threads as they read it. ``packed``
    (optional, from :func:`pack_expert_weights`): the same bf16 weights in the panel layout, read by the forward
    products instead of packing each task's slice (``MoeccConfig.prepack_weights``; refused for quantized
    weights). ``lora_inner`` (optional, float32 ``([T*k, r_gu], [T*k, r_down])``, either None) receives the LoRA
    inner products ``x A`` and ``act A`` in grouped order, for :func:`expert_ffn_backward` to reuse. ``tuning``:
    the kernels' settings (None: the defaults); a value out of range raises ValueError.
    """
    experts, hidden_size, inter = shape
    tokens = hidden.shape[0]
    pairs = tokens * top_k
    routing_struct = _routing(offsets, order, routing, experts, pairs)
    out = _output(out, (tokens, hidden_size), _io_dtype(out, "out"), "out")
    gate_up_out = _output(gate_up_out, (pairs, 2 * inter), torch.bfloat16, "gate_up_out")
    if hidden_copy is not None and any(_overlap(hidden_copy, t) for t in (hidden, out, gate_up_out)):
        raise ValueError("hidden_copy must not share memory with hidden, out or gate_up_out")
    io = _C.ForwardIo()
    io.hidden = _address(hidden, "hidden", torch.bfloat16, tokens * hidden_size)
    io.gate_up_out = gate_up_out.data_ptr()
    if out.dtype == torch.bfloat16:
        io.out_bf16 = out.data_ptr()
    else:
        io.out = out.data_ptr()
    if hidden_copy is not None:
        io.hidden_copy = _address(hidden_copy, "hidden_copy", torch.bfloat16, tokens * hidden_size)
    for field, address in _inner_args(lora_inner, gate_up_lora, down_lora, pairs).items():
        setattr(io, field, address)
    _C.expert_ffn_forward(ISAS[isa], _shapes(experts, hidden_size, inter, tokens, top_k),
                          _matrices(weights, experts, hidden_size, inter, packed),
                          _lora_factors("gate_up", gate_up_lora, experts, hidden_size, 2 * inter),
                          _lora_factors("down", down_lora, experts, inter, hidden_size), routing_struct, io,
                          _DEFAULT_TUNING if tuning is None else tuning)
    return out, gate_up_out


def expert_ffn_backward(isa: str, weights: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int, int], top_k: int,
                        hidden: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor, routing: torch.Tensor,
                        gate_up_lora: tuple | None, down_lora: tuple | None, gate_up_out: torch.Tensor,
                        grad_out: torch.Tensor, grad_hidden: torch.Tensor | None = None,
                        lora_inner: tuple | None = None, tuning: KernelTuning | None = None,
                        lora_grads: tuple | None = None, lora_experts: torch.Tensor | None = None) -> tuple:
    """Backward of :func:`expert_ffn_forward` with ``grad_out [T, H]`` float32 or bf16 (``grad_hidden``
    written into the given tensor when passed: float32, or bf16 rounded once in the kernel). ``lora_inner``: what
    the forward wrote there, reused instead of recomputed (the same LoRA factors, or the gradients are wrong).
    ``tuning`` as for the forward. ``lora_grads`` (optional, ``((dA_gu, dB_gu), (dA_down, dB_down))``, any entry
    None): tensors to write the LoRA gradients into, float32 in the layouts below; the A gradients are zeroed
    here first (the kernel accumulates into them), so any reused buffer will do. ``lora_experts`` (optional, int64
    ``[n]``, distinct expert ids): the LoRA gradients hold those experts' blocks alone, in that order (E becomes n
    in their layouts below); every expert with routed pairs must be among them.

    Returns ``(grad_hidden [T, H], grad_routing [T*k], (dA_gu, dB_gu) or None, (dA_down, dB_down) or None)``,
    float32 but for a bf16 ``grad_hidden``, LoRA gradients as ``A [E, r, in]``, ``B [out, r*E]`` (PEFT's
    layout).
    """
    experts, hidden_size, inter = shape
    tokens = hidden.shape[0]
    pairs = tokens * top_k
    routing_struct = _routing(offsets, order, routing, experts, pairs)
    grad_hidden = _output(grad_hidden, (tokens, hidden_size), _io_dtype(grad_hidden, "grad_hidden"), "grad_hidden")
    grad_out_dtype = _io_dtype(grad_out, "grad_out")
    grad_routing = torch.empty(pairs, dtype=torch.float32)
    slots = None if lora_experts is None else _lora_grad_slots(lora_experts, experts)
    lora_grads = _lora_grad_outputs(lora_grads, gate_up_lora, down_lora, grad_hidden,
                                    None if slots is None else lora_experts.numel())
    io = _C.BackwardIo()
    if slots is not None:
        io.lora_grad_slots, io.lora_grad_experts = slots.data_ptr(), lora_experts.numel()
    io.hidden = _address(hidden, "hidden", torch.bfloat16, tokens * hidden_size)
    io.gate_up_out = _address(gate_up_out, "gate_up_out", torch.bfloat16, pairs * 2 * inter)
    grad_out_address = _address(grad_out, "grad_out", grad_out_dtype, tokens * hidden_size)
    if grad_out_dtype == torch.bfloat16:
        io.grad_out_bf16 = grad_out_address
    else:
        io.grad_out = grad_out_address
    if grad_hidden.dtype == torch.bfloat16:
        io.grad_hidden_bf16 = grad_hidden.data_ptr()
    else:
        io.grad_hidden = grad_hidden.data_ptr()
    io.grad_routing = grad_routing.data_ptr()
    if lora_grads[0] is not None:
        io.grad_gate_up_a, io.grad_gate_up_b = (grad.data_ptr() for grad in lora_grads[0])
    if lora_grads[1] is not None:
        io.grad_down_a, io.grad_down_b = (grad.data_ptr() for grad in lora_grads[1])
    for field, address in _inner_args(lora_inner, gate_up_lora, down_lora, pairs).items():
        setattr(io, field, address)
    _C.expert_ffn_backward(ISAS[isa], _shapes(experts, hidden_size, inter, tokens, top_k),
                           _matrices(weights, experts, hidden_size, inter),
                           _lora_factors("gate_up", gate_up_lora, experts, hidden_size, 2 * inter),
                           _lora_factors("down", down_lora, experts, inter, hidden_size), routing_struct, io,
                           _DEFAULT_TUNING if tuning is None else tuning)
    return grad_hidden, grad_routing, lora_grads[0], lora_grads[1]
