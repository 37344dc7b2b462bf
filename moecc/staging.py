"""Reusable host buffers for device<->host copies of routed activations.

``StagingBuffers``: one buffer per role (hidden in, routing in, output, gradients ...) and calling thread, grown
geometrically and reused by every layer and step, pinned when a CUDA device is in use so copies run
asynchronously at full PCIe rate. A buffer written by the CPU and then copied to the GPU is not reused until that
copy has finished. Per thread: two threads using one model at once (or a forward beside autograd's backward
thread) never write into each other's buffers; forwards and backwards use different roles, so a training loop
(forward on its thread, backward on autograd's) holds each role once.

``HostBufferPool``: whole buffers lent out for longer (activations parked in host memory from a layer's forward
until its backward), each given back with the event after which it may be overwritten.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class StagingBuffers:
    """Named host buffers for one device; ``view`` hands out typed views, ``to_host``/``to_device`` copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._local = threading.local()  # .buffers: role -> buffer, .pending: role -> event; one set per thread
        self._copy_stream = torch.cuda.Stream(device) if self.pinned else None
        self._count_lock = threading.Lock()
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.mapped = self.pinned  # device kernels read pinned buffers in place (False once that failed here)

    def _mine(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.cuda.Event]]:
        """The calling thread's (buffers, pending copies out of them), by role."""
        if not hasattr(self._local, "buffers"):
            self._local.buffers, self._local.pending = {}, {}
            self._local.aliases = {}  # role -> (its buffer, that buffer as a device tensor)
        return self._local.buffers, self._local.pending

    def _count(self, to_host: int = 0, to_device: int = 0) -> None:
        with self._count_lock:
            self.bytes_to_host += to_host
            self.bytes_to_device += to_device

    def view(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` backed by the ``role`` buffer (its previous contents are gone)."""
        buffers, pending_copies = self._mine()
        pending = pending_copies.pop(role, None)
        if pending is not None:
            pending.synchronize()  # the last device copy out of this buffer must finish before we overwrite it
        numel = torch.Size(shape).numel()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * dtype.itemsize
        buffer = buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            buffers[role] = buffer
            self._local.aliases.pop(role, None)  # the old buffer's, which it would keep alive
        return buffer[:nbytes].view(dtype).view(shape)

    def to_host(self, tensors: dict[str, torch.Tensor]) -> HostCopy:
        """Starts copying each device tensor into its role's host buffer; returns a handle to wait on.

        On CUDA the copies run on a side stream that waits only for work queued so far, so later GPU work
        (the shared experts) overlaps with the copy and with the CPU compute that follows.
        """
        views = {role: self.view(role, tuple(t.shape), t.dtype) for role, t in tensors.items()}
        self._count(to_host=sum(t.numel() * t.element_size() for t in tensors.values()))
        if self._copy_stream is None:
            for role, tensor in tensors.items():
                views[role].copy_(tensor)
            return HostCopy(views, None)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for role, tensor in tensors.items():
                views[role].copy_(tensor, non_blocking=True)
                tensor.record_stream(self._copy_stream)
            done = self._copy_stream.record_event()
        return HostCopy(views, done)

    def to_device(self, role: str, host: torch.Tensor) -> torch.Tensor:
        """A new device tensor holding ``host`` (copied through ``role``'s pinned buffer on CUDA)."""
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.copy_to_device(role, host, out)
        return out

    def copy_to_device(self, role: str, host: torch.Tensor, out: torch.Tensor) -> None:
        """Copies ``host`` into the device tensor ``out`` on the current stream.

        On CUDA the data goes through ``role``'s pinned buffer so the copy is asynchronous; the buffer is not
        handed out again until the copy has finished.
        """
        self._count(to_device=host.numel() * host.element_size())
        if not self.pinned:
            out.copy_(host)
            return
        buffer = self.view(role, tuple(host.shape), host.dtype)
        buffer.copy_(host)
        out.copy_(buffer, non_blocking=True)
        self._mine()[1][role] = torch.cuda.current_stream(self.device).record_event()

    def read_on_device(self, tensors: dict[str, torch.Tensor], consume: Callable[..., T]) -> T:
        """``consume(**views)``: each host tensor copied into its role's pinned buffer and seen by device kernels
        as a device tensor over that buffer, which they read across PCIe themselves.

        A copy to the device would queue on the copy engine behind the expert weights already queued for the next
        layer, and the GPU would wait for it. ``consume`` must queue kernels that read the views (an elementwise
        op, a gather; not ``copy_``, which would use the copy engine again) and must not keep them: the buffers
        are reused once its work is done. Without CUDA it is given the host tensors themselves.
        """
        if not self.pinned:
            self._count(to_device=sum(t.numel() * t.element_size() for t in tensors.values()))
            return consume(**tensors)
        buffers = {}
        for role, host in tensors.items():
            buffers[role] = self.view(role, tuple(host.shape), host.dtype)
            buffers[role].copy_(host)
        return self.read_views_on_device(buffers, consume)

    def read_views_on_device(self, views: dict[str, torch.Tensor], consume: Callable[..., T]) -> T:
        """:meth:`read_on_device` of views this thread took with :meth:`view` (role -> view) and filled itself, or
        has another thread fill: then the stream must wait for that before ``consume``'s kernels (``CpuDone``)."""
        self._count(to_device=sum(t.numel() * t.element_size() for t in views.values()))
        if not self.pinned:
            return consume(**views)
        device_views = {}
        try:
            for role, buffer in views.items():
                device_views[role] = self._device_view(role, buffer)
            return consume(**device_views)
        finally:  # also when consume raised after queuing some of its reads
            done = torch.cuda.current_stream(self.device).record_event()
            pending = self._mine()[1]
            for role in device_views:
                pending[role] = done

    def _device_view(self, role: str, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (pinned) as a device tensor (CUDA's unified addressing), or a copy where it cannot be. A view
        of ``role``'s buffer is a view of that buffer's alias, made once per buffer: making one took tens of
        microseconds of the host thread per view (a pointer lookup, ``__cuda_array_interface__``)."""
        if self.mapped and buffer.numel():
            try:
                root = self._mine()[0].get(role)
                if root is None or buffer.data_ptr() != root.data_ptr() or buffer.nbytes > root.nbytes:
                    return device_alias(buffer, self.device)
                held = self._local.aliases.get(role)
                if held is None or held[0] is not root:
                    held = self._local.aliases[role] = (root, device_alias(root, self.device))
                return held[1][:buffer.nbytes].view(buffer.dtype).view(buffer.shape)
            except (RuntimeError, TypeError, ValueError):
                self.mapped = False  # e.g. memory pinned without mapping: copies from now on
        return buffer.to(self.device, non_blocking=True)


class _DeviceArray:
    """A pinned host buffer described by ``__cuda_array_interface__``; holds the buffer while torch holds this."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.__cuda_array_interface__ = {"data": (buffer.data_ptr(), False), "shape": (buffer.nbytes,),
                                         "typestr": "|u1", "version": 2}


def device_alias(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor ``buffer``'s memory (same shape and dtype), no copy: device
    kernels that read it fetch the bytes over PCIe. Raises where the memory is not visible to the device."""
    if not buffer.is_pinned() or not buffer.is_contiguous():
        raise ValueError("device_alias needs a contiguous pinned host tensor")
    device = torch.device(device)
    if device.index is None:  # as_tensor copies to "cuda" a pointer it sees on "cuda:0"; compared numbered below
        device = torch.device("cuda", torch.cuda.current_device())
    raw = torch.as_tensor(_DeviceArray(buffer), device=device)
    if raw.device != device or raw.data_ptr() != buffer.data_ptr():
        # torch placed the memory on another device and copied it there: not a read in place
        raise RuntimeError(f"pinned memory seen on {raw.device}, not {device}")
    return raw.view(buffer.dtype).view(buffer.shape)


class HostCopy:
    """Host views being filled by ``StagingBuffers.to_host``; ``wait()`` returns them once complete."""

    def __init__(self, views: dict[str, torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._views = views
        self._done = done

    def wait(self) -> dict[str, torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._views


class HostBufferPool:
    """Host byte buffers (pinned for CUDA) lent out whole and given back, reused across layers and steps.

    Sizes are powers of two (at least ``min_bytes``), as PyTorch's pinned-memory allocator rounds them anyway,
    so batches of slightly different lengths share buffers. ``acquire`` lends the smallest free buffer that
    fits; when none does, it drops the largest free one (too small) before allocating, so the pool never holds
    more buffers than were lent out at once. Safe to call from autograd's backward threads.
    """

    def __init__(self, pinned: bool, min_bytes: int = 4096) -> None:
        self.pinned = pinned
        self.min_bytes = min_bytes
        self._free: list[tuple[torch.Tensor, object]] = []  # (buffer [nbytes] uint8, event or None)
        self._lock = threading.Lock()
        self.buffers = 0  # held by the pool, lent out or free
        self.nbytes = 0  # their total size
        self.allocations = 0  # buffers ever allocated (pinned allocation is slow: this should stop growing)

    @property
    def free(self) -> int:
        return len(self._free)

    def size_for(self, nbytes: int) -> int:
        return max(self.min_bytes, 1 << max(0, nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """``(buffer, event)``: a buffer of at least ``nbytes`` bytes, and the event (None on the CPU or for a
        new buffer) that whoever writes into it must wait for, since its previous contents may still be read."""
        size = self.size_for(nbytes)
        with self._lock:
            fits = [i for i, (buffer, _) in enumerate(self._free) if buffer.numel() >= size]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
            if self._free:
                dropped, _ = self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i][0].numel()))
                self.buffers, self.nbytes = self.buffers - 1, self.nbytes - dropped.numel()
            self.buffers, self.nbytes = self.buffers + 1, self.nbytes + size
            self.allocations += 1
        # Outside the lock: pinning is slow. A dropped buffer still being copied stays valid until the copy ends
        # (PyTorch's pinned allocator records the copy's event before reusing the memory).
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned), None

    def release(self, buffer: torch.Tensor, event: object = None) -> None:
        """Gives ``buffer`` back; it may be overwritten once ``event`` (a CUDA event, or None) has completed."""
        with self._lock:
            self._free.append((buffer, event))
