"""The GPU waits for the CPU on its own: a counter in pinned host memory that a CUDA stream waits on.

Hybrid's host thread used to block until a layer's CPU part was done before it queued the kernels that add that
part's rows to the output, and only then went on to the next layer's attention. With ``CpuDone`` it queues a wait
on the counter and those kernels at once, and returns: the CPU worker publishes the part's number once its rows
are in their staging buffers, and the stream goes on by itself. The host's launch time for the next layer then
overlaps the CPU part instead of following it.

The wait is CUDA's stream memory operation (``cuStreamWaitValue32``), reached through the driver library with
ctypes; it is used only where CUDA loads every kernel when it starts (``CUDA_MODULE_LOADING=EAGER``) and a
self-test shows it waiting and then going on. Under lazy loading (torch's default) the first launch of a kernel
waits for the work already queued, the pending wait included, while the launching thread holds the GIL that the
worker needs before it can publish: a deadlock (seen on an H100 machine). Elsewhere (no CUDA, no driver
symbol, lazy loading, a failed test) ``on_device`` is False, ``reason`` says why, and ``wait`` blocks the calling
thread instead.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings

import torch

_WORDS_KEPT: list[torch.Tensor] = []  # every CpuDone's word, for the life of the process
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, a cyclic comparison
_WORD = 1 << 32  # numbers are stored modulo 2^32; the device's cyclic comparison handles the wrap


def _libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library torch has loaded already (RTLD_NOLOAD: a second copy would have no context of
    torch's), or None."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def _driver_wait():
    """(``cuStreamWaitValue32``, ``cuStreamWriteValue32``: the CUDA 12 ``_v2`` entries where the driver has them,
    ``cuCtxGetCurrent``, ``cuMemHostGetDevicePointer``), or None where the driver library or a symbol is missing."""
    lib = _libcuda()
    if lib is None:
        return None
    found = []
    for op in ("Wait", "Write"):  # the write releases a self-test's wait that never saw the host's store
        fn = getattr(lib, f"cuStream{op}Value32_v2", None) or getattr(lib, f"cuStream{op}Value32", None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        found.append(fn)
    current = lib.cuCtxGetCurrent
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    pointer = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or getattr(lib, "cuMemHostGetDevicePointer", None)
    if pointer is None:
        return None
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    pointer.restype = ctypes.c_int
    return (*found, current, pointer)


class CpuDone:
    """Numbers handed out per CPU part (``issue``), published by the worker when the part's results are in place
    (``publish``), waited for by a device stream (``wait``) or, without a device wait, by the calling thread.

    The word holds the highest number below which every number is published: a wait for ``n`` is released only
    once ``n`` and every number issued before it are, whatever order the parts finish in (the device compares the
    word, so a later part finishing first must not release an earlier part's wait)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cond = threading.Condition()
        self._issued = 0
        self._published = 0  # every number up to this one is published
        self._early: set[int] = set()  # published numbers above it
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        # Never freed: a stream may still wait on the word after this object is gone (a failed step), and torch's
        # pinned cache would hand the block to a new word that starts at 0
        if device.type == "cuda":
            _WORDS_KEPT.append(self._flag)
        self._word = self._flag.numpy()  # stores go straight to the pinned word the device reads
        self._driver = _driver_wait() if device.type == "cuda" else None
        self._address = 0  # the word's device address (the driver's, for pinned memory torch registered)
        self.reason = self._unusable_because()
        self.on_device = not self.reason

    def _unusable_because(self) -> str:
        """Why the device cannot wait on its own here ('' where it can)."""
        if self.device.type != "cuda":
            return "no CUDA device"
        if self._driver is None:
            return "the CUDA driver has no stream memory operations"
        torch.cuda.init()
        if _lazy_loading():
            return ("CUDA loads kernels lazily (set CUDA_MODULE_LOADING=EAGER before CUDA starts for device-side "
                    "waits)")
        if not self._self_test():
            return "a stream waiting on pinned host memory failed its self-test"
        return ""

    def issue(self) -> int:
        """A new number, published later by exactly one ``publish`` (or by ``release_all``)."""
        with self._cond:
            self._issued += 1
            return self._issued

    def publish(self, number: int) -> None:
        """Part ``number``'s results are in place (call after writing them; parts may finish in any order, and
        the word moves on only over numbers all published)."""
        with self._cond:
            if number > self._published:
                self._early.add(number)
                while self._published + 1 in self._early:
                    self._published += 1
                    self._early.discard(self._published)
                self._word[0] = _as_int32(self._published)
            self._cond.notify_all()

    def release_all(self) -> None:
        """Publishes every number handed out, so no stream is left waiting (parts that will never run)."""
        with self._cond:
            for number in range(self._published + 1, self._issued + 1):
                self._early.add(number)
        self.publish(self._issued)

    def published(self, number: int) -> bool:
        with self._cond:
            return self._published >= number

    def wait(self, number: int, stream: torch.cuda.Stream | None = None) -> None:
        """Until ``number`` is published: queued on ``stream`` (the current one) where ``on_device``, else here."""
        if self.on_device:
            try:
                self._queue(stream or torch.cuda.current_stream(self.device), number)
                return
            except RuntimeError as error:  # the caller waits from now on, as where the self-test fails
                self.on_device = False
                warnings.warn(f"moecc: the GPU can no longer wait for the CPU on its own ({error}); the host "
                              "waits for each CPU part instead (slower, same results)", RuntimeWarning, stacklevel=2)
        with self._cond:
            self._cond.wait_for(lambda: self._published >= number)

    def _queue(self, stream: torch.cuda.Stream, number: int) -> None:
        with torch.cuda.device(self.device):  # the driver call uses the current device's context
            self._memop(0, stream, number)

    def _memop(self, which: int, stream: torch.cuda.Stream, number: int) -> None:
        """Queues on ``stream`` a wait for the word to reach ``number`` (``which`` 0) or a write of it (1)."""
        op, current = self._driver[which], self._driver[2]
        name = ("cuStreamWaitValue32", "cuStreamWriteValue32")[which]
        context = ctypes.c_void_p()
        if current(ctypes.byref(context)) != 0 or not context.value:
            raise RuntimeError(f"{name}: no CUDA context is current on this thread")
        result = op(ctypes.c_void_p(stream.cuda_stream), self._device_address(), number % _WORD,
                    _WAIT_GEQ if which == 0 else 0)
        if result != 0:
            raise RuntimeError(f"{name} failed with CUDA driver error {result}")

    def _device_address(self) -> int:
        """The word's address for the device, from the driver (equal to the host's under unified addressing)."""
        if not self._address:
            address = ctypes.c_uint64()
            result = self._driver[3](ctypes.byref(address), ctypes.c_void_p(self._flag.data_ptr()), 0)
            if result != 0:
                raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUDA driver error {result}")
            self._address = address.value
        return self._address

    def _self_test(self) -> bool:
        """Whether a wait the device has reached holds its stream until the number is published from here, and
        then lets it go. Publishing right after queuing would only show that a word already set passes."""
        try:
            stream = torch.cuda.Stream(self.device)
            number = self.issue()
            with torch.cuda.device(self.device):
                reached = stream.record_event()
                self._queue(stream, number)
                after = stream.record_event()
            if not _settles(reached, 5.0):  # a busy device: publish and release below, untested
                self._release(number, after)
                return False
            time.sleep(0.02)  # the device is at the wait now
            held = not after.query()
            self.publish(number)
            if _settles(after, 5.0):
                return held
            self._release(number, after)
            return False
        except (RuntimeError, OSError, ctypes.ArgumentError):
            self.release_all()
            return False

    def _release(self, number: int, after: torch.cuda.Event) -> None:
        """Publishes a self-test's ``number`` and, where the wait did not see that, releases it with a device
        write from another stream: a stream left waiting would hang every later sync of the device."""
        self.publish(number)
        if _settles(after, 1.0):
            return
        release = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            self._memop(1, release, number)
        if not _settles(after, 5.0):
            warnings.warn("moecc: a CUDA stream still waits for a word in pinned memory after its self-test; "
                          "device syncs may hang (please report this GPU and driver)", RuntimeWarning)


def _lazy_loading() -> bool:
    """Whether the CUDA context loads kernels at their first launch (``cuModuleGetLoadingMode``; drivers without
    it predate lazy loading)."""
    lib = _libcuda()
    if lib is None:
        return True
    get = getattr(lib, "cuModuleGetLoadingMode", None)
    if get is None:
        return False
    mode = ctypes.c_int()
    get.argtypes = [ctypes.POINTER(ctypes.c_int)]
    get.restype = ctypes.c_int
    return get(ctypes.byref(mode)) != 0 or mode.value != 1  # CU_MODULE_EAGER_LOADING


def _as_int32(number: int) -> int:
    """``number`` modulo 2^32 as the signed 32-bit value with the same bits (what the word holds)."""
    return (number + (1 << 31)) % _WORD - (1 << 31)


def _settles(event: torch.cuda.Event, seconds: float) -> bool:
    """Whether ``event`` completes within ``seconds`` (polled: a blocking wait could be for ever)."""
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True
