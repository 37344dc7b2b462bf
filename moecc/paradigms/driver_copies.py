"""Host-to-device copies of runs of experts, queued through the CUDA driver (``cuMemcpyHtoDAsync``).

Hybrid's GPU part is a scattered subset of a layer's experts: tens of runs a layer, two copies each. Queued through
torch (a sliced tensor's ``copy_``), every copy cost the host thread tens of microseconds, 2.6-3.7 ms of each
layer pass at 512 tokens, on the thread whose time bounded hybrid's backward there. Here a copy is address arithmetic and one ctypes call.

Used where the driver has the entry point and a self-test copy arrives intact; elsewhere (no CUDA, no driver, a
failed test) ``usable`` is False, ``reason`` says why, and callers copy through torch.
"""
from __future__ import annotations

import ctypes
import warnings

import torch

from .device_wait import _libcuda


def run_copies(device: torch.Tensor, host: torch.Tensor, runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(device address, host address, bytes)`` copying experts ``[start, stop)`` of each run of ``host`` into the
    same experts of ``device`` (both contiguous ``[E, ...]`` of one shape and dtype)."""
    if device.shape != host.shape or device.dtype != host.dtype or not (device.is_contiguous()
                                                                     and host.is_contiguous()):
        raise ValueError(f"run_copies needs two contiguous tensors of one shape and dtype, got {device.dtype} "
                         f"{list(device.shape)} and {host.dtype} {list(host.shape)}")
    expert = host[0].nbytes if host.shape[0] else 0
    to, source = device.data_ptr(), host.data_ptr()
    return [(to + start * expert, source + start * expert, (stop - start) * expert) for start, stop in runs]


def _driver_copy():
    """(``cuMemcpyHtoDAsync_v2``, ``cuCtxGetCurrent``), or None where the driver library or a symbol is missing."""
    lib = _libcuda()
    if lib is None:
        return None
    copy = getattr(lib, "cuMemcpyHtoDAsync_v2", None)
    current = getattr(lib, "cuCtxGetCurrent", None)
    if copy is None or current is None:
        return None
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    return copy, current


class DriverCopies:
    """Queues host-to-device copies on a stream through the driver; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._driver = _driver_copy() if device.type == "cuda" else None
        self.reason = self._unusable_because()
        self.usable = not self.reason

    def _unusable_because(self) -> str:
        if self.device.type != "cuda":
            return "no CUDA device"
        if self._driver is None:
            return "the CUDA driver library or its cuMemcpyHtoDAsync is missing"
        try:
            if not self._self_test():
                return "a copy queued through the driver did not arrive intact in its self-test"
        except (RuntimeError, OSError, ctypes.ArgumentError) as error:
            return f"a copy queued through the driver failed its self-test ({error})"
        return ""

    def queue(self, stream: torch.cuda.Stream, copies: list[tuple[int, int, int]]) -> bool:
        """Queues ``copies`` (``run_copies``) on ``stream``; False where this thread has no current CUDA context or
        a copy fails, and then the caller copies them all through torch (copying again what went through is
        harmless). A failed copy ends the driver's use here for good (``usable``, ``reason``)."""
        copy, current = self._driver
        with torch.cuda.device(self.device):  # the stream's device's context is the current one
            context = ctypes.c_void_p()
            if current(ctypes.byref(context)) != 0 or not context.value:
                return False
            handle = ctypes.c_void_p(stream.cuda_stream)
            for to, source, nbytes in copies:
                result = copy(to, source, nbytes, handle) if nbytes else 0
                if result != 0:
                    self.usable = False
                    self.reason = f"cuMemcpyHtoDAsync failed with CUDA driver error {result}"
                    warnings.warn(f"moecc: {self.reason}; expert copies go through torch from now on",
                                  RuntimeWarning, stacklevel=2)
                    return False
        return True

    def _self_test(self) -> bool:
        """Whether two runs of a pinned tensor copied through the driver land where torch's slices say, leaving
        the experts between them untouched."""
        host = (torch.arange(6000, dtype=torch.int32) % 251).to(torch.uint8).view(6, 1000).pin_memory()  # no RNG
        device = torch.zeros(host.shape, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream(self.device)
        torch.cuda.current_stream(self.device).synchronize()  # the zeros are written
        if not self.queue(stream, run_copies(device, host, [(0, 2), (3, 5)])):
            return False
        stream.synchronize()
        expected = host.clone()
        expected[2], expected[5] = 0, 0
        return torch.equal(device.cpu(), expected)
