"""Reusable host buffers for device<->host copies of routed activations.

One buffer per role (hidden in, routing in, output, gradients ...), grown geometrically and reused by every
layer and step, pinned when a CUDA device is in use so copies run asynchronously at full PCIe rate. A buffer
written by the CPU and then copied to the GPU is not reused until that copy has finished.
"""
from __future__ import annotations

import torch


class StagingBuffers:
    """Named host buffers for one device; ``view`` hands out typed views, ``to_host``/``to_device`` copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.cuda.Event] = {}
        self._copy_stream = torch.cuda.Stream(device) if self.pinned else None
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def view(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` backed by the ``role`` buffer (its previous contents are gone)."""
        pending = self._pending.pop(role, None)
        if pending is not None:
            pending.synchronize()  # the last device copy out of this buffer must finish before we overwrite it
        numel = torch.Size(shape).numel()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self._buffers[role] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    def to_host(self, tensors: dict[str, torch.Tensor]) -> "HostCopy":
        """Starts copying each device tensor into its role's host buffer; returns a handle to wait on.

        On CUDA the copies run on a side stream that waits only for work queued so far, so later GPU work
        (the shared experts) overlaps with the copy and with the CPU compute that follows.
        """
        views = {role: self.view(role, tuple(t.shape), t.dtype) for role, t in tensors.items()}
        self.bytes_to_host += sum(t.numel() * t.element_size() for t in tensors.values())
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
        self.bytes_to_device += host.numel() * host.element_size()
        if not self.pinned:
            out.copy_(host)
            return
        buffer = self.view(role, tuple(host.shape), host.dtype)
        buffer.copy_(host)
        out.copy_(buffer, non_blocking=True)
        self._pending[role] = torch.cuda.current_stream(self.device).record_event()


class HostCopy:
    """Host views being filled by ``StagingBuffers.to_host``; ``wait()`` returns them once complete."""

    def __init__(self, views: dict[str, torch.Tensor], done: "torch.cuda.Event | None") -> None:
        self._views = views
        self._done = done

    def wait(self) -> dict[str, torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._views
