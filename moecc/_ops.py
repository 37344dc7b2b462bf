"""The only importer of ``moecc._C``: checks every tensor before its address crosses into C++.

C++ trusts what it is given, so dtype, device, contiguity and sizes are validated here, and every buffer the
native side writes is allocated here and owned by the returned tensors.
"""
from __future__ import annotations

import atexit

import torch

from . import _C


def _check_host(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be in host memory, got a tensor on {tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def group_tokens_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable counting sort of routed (token, slot) pairs by expert.

    Args:
        top_k_index: ``[T, k]`` expert ids in host memory (any integer dtype).
        num_experts: number of experts E; every id must lie in ``[0, E)``.

    Returns:
        ``(offsets [E+1], order [T*k])`` int64: expert ``e`` owns pair ids ``order[offsets[e]:offsets[e+1]]``,
        ascending; pair ``p`` is token ``p // k``, slot ``p % k``.
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
    offsets = torch.empty(num_experts + 1, dtype=torch.int64)
    order = torch.empty(num_tokens * top_k, dtype=torch.int64)
    try:
        _C.group_tokens_by_expert(
            index.data_ptr(), num_tokens, top_k, num_experts, offsets.data_ptr(), order.data_ptr()
        )
    except IndexError as error:  # pybind11 maps std::out_of_range to IndexError
        raise ValueError(f"invalid routing: {error}") from None
    return offsets, order


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
    _C._pool_fill_test(out.data_ptr(), int(n))
    return out


def pool_raise_test(n: int, failing_task: int) -> None:
    """Test hook: run ``n`` pool tasks where ``failing_task`` throws; the error surfaces as RuntimeError."""
    _C._pool_raise_test(int(n), int(failing_task))


atexit.register(_C.shutdown)
