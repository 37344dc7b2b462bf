"""Parking: an offloaded layer's saved state in host memory between its forward and its backward.

What a layer keeps for its backward (``SavedState``: hidden ``[T, H]``, pre-activations ``[T*k, 2I]``, routing
weights and grouping, ~29 KB per token for Qwen3-30B-A3B) is copied device to host on a side stream once the
layer's forward is computed, and brought back in backward one layer ahead, next to the prefetched expert weights.
"""
from __future__ import annotations

import time
import weakref

import torch
from torch.profiler import record_function

from ..experts import SavedState
from ..staging import HostBufferPool
from .event_spans import EventSpans, timed_event

SAVED_TENSORS = ("hidden", "top_k_weights", "offsets", "order", "gate_up_out")  # SavedState's tensor fields
_PARK_ALIGN = 64  # bytes; each tensor's offset in a parked buffer


class ParkedState:
    """One layer's :class:`SavedState` in host memory, from its forward until its backward.

    ``views`` are the state's tensors inside one pooled host buffer, valid once ``parked`` (an event; None on the
    CPU) has completed. :meth:`ActivationParking.restore` copies them into ``device`` tensors, ready at ``ready``,
    and gives the buffer back to the pool.
    """

    def __init__(self, parking: ActivationParking, key: tuple[int, int], buffer: torch.Tensor,
                 views: list[torch.Tensor], parked, weights_dtype: torch.dtype, nbytes: int) -> None:
        self.parking, self.key, self.nbytes = parking, key, nbytes
        self.buffer, self.views, self.parked = buffer, views, parked
        self.weights_dtype = weights_dtype
        self.device: list[torch.Tensor] | None = None
        self.ready = None

    def __del__(self) -> None:  # a graph freed without its backward: the buffer goes back to the pool
        self.parking.discard(self)


class ActivationParking:
    """Moves offloaded layers' saved states to host memory after their forward and back before their backward.

    Device to host runs on a stream of its own, after the layer's compute: PCIe is full duplex, so it overlaps
    the next layer's weight copies. Host to device runs on the engine's copy stream, queued with the weight
    copies it is prefetched alongside. Host buffers (pinned on CUDA) come from one pool, reused by every layer and
    step. Layout of a parked buffer: ``SAVED_TENSORS`` one after another, each at a 64-byte aligned offset.
    """

    def __init__(self, device: torch.device, copy_stream: torch.cuda.Stream | None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = copy_stream
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = HostBufferPool(pinned=self.cuda)
        self.bytes_to_host = self.bytes_to_device = 0
        self.to_host_s = self.to_device_s = 0.0  # measured directly where copies are synchronous (no CUDA)
        self.to_host_events = EventSpans()
        self.to_device_events = EventSpans()
        self._waiting: dict[tuple[int, int], weakref.ref] = {}  # parked, not yet restored: (pass, layer) -> state

    def reset_metrics(self) -> None:
        self.to_host_s = self.to_device_s = 0.0
        self.to_host_events.reset()
        self.to_device_events.reset()

    def park(self, key: tuple[int, int], saved: SavedState) -> ParkedState:
        """Starts copying ``saved`` into a host buffer, after the work queued so far on the current stream."""
        tensors = [getattr(saved, name) for name in SAVED_TENSORS]
        offsets, total = [], 0
        for tensor in tensors:
            offsets.append(total)
            total += -(-tensor.nbytes // _PARK_ALIGN) * _PARK_ALIGN
        buffer, previous_reader = self.pool.acquire(total)
        views = [buffer[o:o + t.nbytes].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)]
        nbytes = sum(t.nbytes for t in tensors)
        self.bytes_to_host += nbytes
        with record_function("moecc.offload.park"):
            parked = self._copy_to_host(views, tensors, previous_reader)
        state = ParkedState(self, key, buffer, views, parked, saved.weights_dtype, nbytes)
        self._waiting[key] = weakref.ref(state)
        return state

    def _copy_to_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor], previous_reader):
        """Copies ``tensors`` into ``views``; returns the event marking the end (None on the CPU)."""
        if not self.cuda:
            start = time.perf_counter()
            for view, tensor in zip(views, tensors):
                view.copy_(tensor)
            self.to_host_s += time.perf_counter() - start
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the state is computed
        if previous_reader is not None:
            self.stream.wait_event(previous_reader)  # the buffer's last copy to the device has read it
        with torch.cuda.stream(self.stream):
            begin = timed_event(self.stream)
            for view, tensor in zip(views, tensors):
                view.copy_(tensor, non_blocking=True)
                if tensor.is_cuda and tensor.numel():
                    tensor.record_stream(self.stream)  # its memory is not reused before the copy ends
            parked = timed_event(self.stream)
        self.to_host_events.add(begin, parked)
        return parked

    def restore(self, state: ParkedState) -> None:
        """Starts copying ``state`` back to the device (on the copy stream); nothing if already started."""
        if state.buffer is None:
            return
        self._forget(state)
        self.bytes_to_device += state.nbytes
        with record_function("moecc.offload.unpark"):
            state.device, state.ready = self._copy_to_device(state.views, state.parked)
        self.pool.release(state.buffer, state.ready)  # refilled only after this copy has read it
        state.buffer = state.views = None

    def _copy_to_device(self, views: list[torch.Tensor], parked) -> tuple[list[torch.Tensor], object]:
        """New device tensors holding ``views`` once ``parked`` is done, and the event marking the copies' end."""
        if not self.cuda:
            start = time.perf_counter()
            tensors = [view.clone() for view in views]
            self.to_device_s += time.perf_counter() - start
            return tensors, None
        stream = self.copy_stream
        with torch.cuda.stream(stream):  # allocated for the copy stream; take() hands them to the compute stream
            if parked is not None:
                stream.wait_event(parked)
            begin = timed_event(stream)
            tensors = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in views]
            for tensor, view in zip(tensors, views):
                tensor.copy_(view, non_blocking=True)
            ready = timed_event(stream)
        self.to_device_events.add(begin, ready)
        return tensors, ready

    def prefetch(self, key: tuple[int, int]) -> None:
        """Starts restoring the state parked under ``key`` (forward pass, layer), if there is one."""
        ref = self._waiting.get(key)
        state = ref() if ref is not None else None
        if state is not None:
            self.restore(state)

    def take(self, state: ParkedState) -> tuple[SavedState, object]:
        """``(the state on the device, the event the current stream must wait for before reading it)``."""
        self.restore(state)
        tensors, state.device = state.device, None
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for tensor in tensors:
                if tensor.numel():
                    tensor.record_stream(stream)  # allocated for the copy stream, freed after this one's reads
        saved = SavedState(**dict(zip(SAVED_TENSORS, tensors)), weights_dtype=state.weights_dtype)
        return saved, state.ready

    def discard(self, state: ParkedState) -> None:
        """Gives back the buffer of a state that will never be restored."""
        if state.buffer is not None:
            self._forget(state)
            self.pool.release(state.buffer, state.parked)
            state.buffer = state.views = None

    def _forget(self, state: ParkedState) -> None:
        ref = self._waiting.get(state.key)
        if ref is not None and ref() in (state, None):
            self._waiting.pop(state.key, None)

