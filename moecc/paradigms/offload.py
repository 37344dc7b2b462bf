"""Offload paradigm: routed experts computed on the device after their weights are copied there.

Expert weights stay in host memory (pinned on CUDA), one copy. Per MoE layer the engine copies the experts the
batch routes to (all of them when most are hit) into a device slot on a dedicated copy stream. While a layer
computes, the next layer's experts are already being copied when the batch is large enough to touch most
experts; in backward, where every layer's routed experts are known from forward, the previous layer's experts
are copied while the current one computes. Slots are bounded (by the GPU memory budget) and reused.

The expert math on the device is chosen per engine (``OffloadEngine.compute``, from
``MoeccConfig.offload_compute``): ``"grouped"`` (``moecc.experts.grouped``: one grouped matrix product per
projection, LoRA factorised; agrees with HF + PEFT to the dtype's rounding; the default on CUDA) or ``"reference"``
(``moecc.experts.reference``: one expert at a time with PEFT's folded ``W + ΔW``, bit-exact with HF + PEFT; the default
elsewhere, so CPU runs stay exact). The expert LoRA factors (``MoeccConfig.offload_lora``) live on the device
when they fit a quarter of the budget with their gradients and optimizer state, and are used in place there;
otherwise they stay host parameters (pinned on CUDA), copied to the device once per forward pass. With a cache
budget (``MoeccConfig.offload_cache_gb``) the most frequently routed experts also stay on the device
(``moecc.paradigms.expert_cache``) and fill slots without crossing PCIe.

What a layer keeps for its backward (``SavedState``: hidden ``[T, H]``, pre-activations ``[T*k, 2I]``, routing
weights and grouping, ~29 KB per token for Qwen3-30B-A3B) is parked in host memory between its forward and its
backward (``OffloadEngine.park_activations``, default on): copied device to host on a side stream once the
layer's forward is computed, and brought back in backward one layer ahead, next to the prefetched expert
weights. A forward run inside backward (a checkpointed layer recomputed) keeps its state on the device instead,
and prefetches nothing forwards.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..config import MoeccConfig
from ..experts import ExpertLora, ExpertWeights, SavedState
from ..experts.select import default_device_backend, device_backend
from ..lora import lora_tensors
from ..staging import HostBufferPool
from .base import (BUDGET_SLACK, Engine, ExpertLayer, Pending, Ready, expert_lora_params, node_gradients,
                   resident_weight_bytes, routed_counts, saved_state_gone)
from .driver_copies import DriverCopies, run_copies
from .event_spans import EventSpans
from .cache_sizing import CacheSizer
from .expert_cache import CudaPeakMemory, ExpertCache
from .step_guard import size_bucket

SAVED_TENSORS = ("hidden", "top_k_weights", "offsets", "order", "gate_up_out")  # SavedState's tensor fields
_PARK_ALIGN = 64  # bytes; each tensor's offset in a parked buffer


class _Slot:
    """Device copies of one layer's experts; ``present`` says which experts hold valid data."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.layer: int | None = None
        self.revision: tuple = ()  # PEFT merge state the copies were made under
        self.present: set[int] = set()
        self.ready: torch.cuda.Event | None = None  # copies into the slot done
        self.released: torch.cuda.Event | None = None  # compute reading the slot done
        # Device copies of the layer's expert LoRA factors (``lora_tensors`` order), and the forward pass and host
        # tensors they were copied in and from (see ``OffloadEngine._lora_current``).
        self.lora: list[torch.Tensor | None] = []
        self.lora_key: tuple | None = None


def _timed_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


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
            begin = _timed_event(self.stream)
            for view, tensor in zip(views, tensors):
                view.copy_(tensor, non_blocking=True)
                if tensor.is_cuda and tensor.numel():
                    tensor.record_stream(self.stream)  # its memory is not reused before the copy ends
            parked = _timed_event(self.stream)
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
            begin = _timed_event(stream)
            tensors = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in views]
            for tensor, view in zip(tensors, views):
                tensor.copy_(view, non_blocking=True)
            ready = _timed_event(stream)
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


def _runs(experts: list[int], sources: dict) -> list[tuple[int, int, tuple | None]]:
    """``experts`` as ``(start, stop, cached)`` runs: consecutive experts copied from host memory in one go
    (``cached`` None), experts the cache holds one at a time (``cached`` their device ``(gate_up, down)``).
    A whole layer is then two copies instead of two per expert, each of which costs the host ~40 us to queue."""
    runs: list[tuple[int, int, tuple | None]] = []
    for expert in sorted(experts):
        cached = sources[expert]
        if cached is None and runs and runs[-1][2] is None and runs[-1][1] == expert:
            runs[-1] = (runs[-1][0], expert + 1, None)
        else:
            runs.append((expert, expert + 1, cached))
    return runs


def _copy_runs(slot: _Slot, host: ExpertWeights, runs: list[tuple[int, int, tuple | None]],
               stream: torch.cuda.Stream | None, driver: DriverCopies | None = None) -> None:
    """Copies each run into the slot (on the current stream: ``stream``, the copy stream, on CUDA); the runs from
    host memory through ``driver`` where it is usable and the slot and weights are contiguous (``driver_copies``:
    a fraction of torch's host time per copy)."""
    plain = [(start, stop) for start, stop, cached in runs if cached is None]
    if (driver is not None and driver.usable and stream is not None and plain
            and host.gate_up.device.type == "cpu" and host.down.device.type == "cpu"
            and all(t.is_contiguous() for t in (slot.gate_up, slot.down, host.gate_up, host.down))):
        copies = run_copies(slot.gate_up, host.gate_up, plain) + run_copies(slot.down, host.down, plain)
        if driver.queue(stream, copies):
            runs = [run for run in runs if run[2] is not None]
    for start, stop, cached in runs:
        if cached is None:
            gate_up, down = host.gate_up[start:stop], host.down[start:stop]
        else:
            gate_up, down = cached[0].unsqueeze(0), cached[1].unsqueeze(0)
        slot.gate_up[start:stop].copy_(gate_up, non_blocking=stream is not None)
        slot.down[start:stop].copy_(down, non_blocking=stream is not None)
        if cached is not None and stream is not None:  # a refill may drop the entry while this copy still reads it
            gate_up.record_stream(stream)
            down.record_stream(stream)


class OffloadEngine(Engine):
    """Copy stream, device slots (LRU over layers), activation parking, metrics, and the layer list for
    prefetching. ``compute``: ``MoeccConfig.offload_compute``'s names (None: ``"auto"``)."""

    name = "offload"

    def __init__(self, device: torch.device, slots: int = 2, compute: str | None = None,
                 cache_bytes: int = 0, cache_limit: int | None = None) -> None:
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which have one
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        # Device copies of the hottest experts (moecc.paradigms.expert_cache); None when no budget is given.
        # With ``cache_limit`` (offload_cache_gb="auto") the budget follows each batch size's measured peak
        # (moecc.paradigms.cache_sizing), read through ``peak_memory`` (None off CUDA: the cache stays empty).
        auto = cache_limit is not None
        self.cache = ExpertCache(device, cache_bytes) if cache_bytes > 0 or auto else None
        self.cache_sizer = CacheSizer(cache_limit) if auto else None
        self.peak_memory = CudaPeakMemory(device) if auto and device.type == "cuda" else None
        # (tokens, training, cache bytes, backward_calls) of the pass running, at its start
        self._cache_pass: tuple[int, bool, int, int] | None = None
        self.capacity = max(1, slots)
        self.compute = default_device_backend(device) if compute in (None, "auto") else compute
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.driver_copies = DriverCopies(device) if device.type == "cuda" else None
        self.slots: OrderedDict[int, _Slot] = OrderedDict()
        # Park each layer's saved state in host memory between its forward and its backward (see the module
        # docstring); False keeps it on the device. On the CPU the same path runs with plain host copies.
        self.park_activations = True
        # Expert LoRA factors on the device already (MoeccConfig.offload_lora): used in place, never staged.
        self.lora_on_device = False
        self.parking = ActivationParking(device, self.copy_stream)
        # Held by each layer call's forward and backward: slots are shared, so two threads using one model take
        # turns layer by layer (reentrant: a checkpointed layer's recomputation may run on the thread holding it).
        self.lock = threading.RLock()
        self.h2d_bytes = 0  # expert weights copied to the device
        self.experts_copied = 0  # of them, whole experts (hybrid's cost model times them)
        self.copy_s = 0.0  # measured directly where copies are synchronous (no CUDA)
        self._mark = (0, 0, 0)
        self._cache_mark = 0
        # CUDA event pairs: around each batch of copies on the copy stream, and around each wait of the compute
        # stream for a slot; read (and synchronised) only when metrics are asked for.
        self._copy_events = EventSpans()
        self._wait_events = EventSpans()
        self._compute_events = EventSpans()  # around each expert computation on the compute stream

    @property
    def compute(self) -> str:
        """Expert math on the device: ``"grouped"`` or ``"reference"`` (see the module docstring)."""
        return self._compute

    @compute.setter
    def compute(self, value: str) -> None:
        device_backend(value, "OffloadEngine.compute")  # refuses unknown names, saying which exist
        self._compute = value

    @classmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> OffloadEngine:
        return cls(device, config.offload_slots, config.offload_compute, *cache_setting(device, config))

    def add_layer(self, name: str, experts: torch.nn.Module, wrappers: dict) -> OffloadLayer:
        """The layer, its experts' weights pinned on CUDA: copied to the device every layer call, from pageable
        memory each copy would stall the host while CUDA stages it."""
        if self.device.type == "cuda":
            pin_experts(experts)
        return super().add_layer(name, experts, wrappers)

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        """Decides where the expert LoRA lives and puts the factors there (after ``keep_on_host`` moved the
        experts' subtree to host memory)."""
        self.lora_on_device = lora_on_device(model, self.layers, self.device, config)
        self.place_lora(expert_lora_params(self.layers))

    def pass_begins(self, tokens: int, training: bool = True) -> None:
        if self.cache_sizer is not None:
            self._size_cache(tokens, training)
        if self.cache is not None:
            self.cache.refill(self.layers, self.copy_stream)  # from the routing of the passes so far
            if self.cache_sizer is not None:
                self._cache_pass = (tokens, training, self.cache.bytes, self.backward_calls)
                if self.peak_memory is not None:
                    self.peak_memory.reset()  # this pass's peak starts with its cache in place

    def _size_cache(self, tokens: int, training: bool) -> None:
        """Files the span of the pass before (up to now) with its peak, less its cache; gives the cache what a pass
        of ``tokens`` leaves."""
        if self._cache_pass is not None and self.peak_memory is not None:
            before, was_training, cache_bytes, backward_calls = self._cache_pass
            self.cache_sizer.observe(before, self.peak_memory.peak(), cache_bytes,
                                     backward=self.backward_calls > backward_calls, training=was_training)
        self.cache.resize(self.cache_sizer.budget(tokens, training))

    def gpu_bytes(self, config: MoeccConfig) -> int:
        return offload_gpu_bytes(self.layers, config, self.lora_on_device)

    def budget_advice(self) -> str:
        return (" or lower offload_slots / offload_cache_gb"
                + (" or keep the expert LoRA in host memory (offload_lora='host')" if self.lora_on_device else ""))

    def reset_metrics(self) -> None:
        self.metrics.reset()
        self.parking.reset_metrics()
        self._mark = (self.h2d_bytes, self.parking.bytes_to_device, self.parking.bytes_to_host)
        self._cache_mark = self.cache.hits if self.cache is not None else 0
        self.copy_s = 0.0
        for spans in (self._copy_events, self._wait_events, self._compute_events):
            spans.reset()

    def compute_begins(self) -> tuple:
        """Marks the start of expert math on the compute stream; pass the result to :meth:`compute_ends`."""
        event = _timed_event(torch.cuda.current_stream(self.device)) if self.device.type == "cuda" else None
        return time.perf_counter(), event

    def compute_ends(self, begun: tuple, backward: bool) -> None:
        """Adds the expert math's time: GPU time between events on CUDA, wall time elsewhere."""
        start, event = begun
        if event is not None:
            self._compute_events.add(event, _timed_event(torch.cuda.current_stream(self.device)))
        elif backward:
            self.metrics.cpu_backward_s += time.perf_counter() - start
        else:
            self.metrics.cpu_forward_s += time.perf_counter() - start

    def counters_since_reset(self) -> dict[str, float]:
        """Same keys as the co-compute engine's; ``cpu_experts_s`` is 0. ``h2d_gb`` counts expert weights, their
        LoRA factors and restored activations, ``d2h_gb`` parked activations. ``copy_s`` is the time
        host-to-device copies took, ``d2h_s`` the time parking copies took (a stream of their own, overlapping
        the others), ``gpu_wait_s`` the time the compute stream stalled waiting for copies and
        ``expert_compute_s`` the device time of the expert math (all from CUDA events on a GPU)."""
        m, parking = self.metrics, self.parking
        weights_mark, restored_mark, parked_mark = self._mark
        h2d = self.h2d_bytes - weights_mark + parking.bytes_to_device - restored_mark
        copy_s = (self.copy_s + parking.to_device_s + self._copy_events.seconds()
                  + parking.to_device_events.seconds())
        return {"cpu_experts_s": 0.0, "h2d_gb": h2d / 1e9, "d2h_gb": (parking.bytes_to_host - parked_mark) / 1e9,
                "gpu_wait_s": m.wait_s + self._wait_events.seconds(), "tokens": float(m.tokens),
                "routing_skew": m.routing_skew, "copy_s": copy_s,
                "d2h_s": parking.to_host_s + parking.to_host_events.seconds(),
                "expert_compute_s": m.cpu_forward_s + m.cpu_backward_s + self._compute_events.seconds(),
                "cache_hits": float(self.cache.hits - self._cache_mark) if self.cache is not None else 0.0,
                "cache_gb": self.cache.bytes / 1e9 if self.cache is not None else 0.0}

    def _slot_for(self, layer: OffloadLayer) -> _Slot:
        if layer.index in self.slots:
            self.slots.move_to_end(layer.index)
            return self.slots[layer.index]
        host = layer.weights
        if len(self.slots) < self.capacity:
            slot = _Slot(torch.empty(host.gate_up.shape, dtype=host.gate_up.dtype, device=self.device),
                         torch.empty(host.down.shape, dtype=host.down.dtype, device=self.device))
        else:
            _, slot = self.slots.popitem(last=False)
            if slot.gate_up.shape != host.gate_up.shape or slot.gate_up.dtype != host.gate_up.dtype:
                slot = _Slot(torch.empty_like(host.gate_up, device=self.device),
                             torch.empty_like(host.down, device=self.device))
            elif slot.released is not None and self.copy_stream is not None:
                self.copy_stream.wait_event(slot.released)  # the last reader of this slot must finish first
        slot.layer, slot.present, slot.ready = layer.index, set(), None
        self.slots[layer.index] = slot
        return slot

    def holds_all(self, layer: OffloadLayer) -> bool:
        """Whether the layer's slot has (or is being sent) every expert, as of the current merge state."""
        slot = self.slots.get(layer.index)
        return (slot is not None and slot.revision == layer.revision()
                and len(slot.present) == layer.weights.num_experts)

    def fetch(self, layer: OffloadLayer, experts: list[int], lora: tuple | None = None) -> _Slot:
        """Starts copying the experts the slot lacks, and the layer's LoRA factors (``lora``, default: what the
        layer applies now) unless the slot holds them from this forward pass; returns the slot (wait on
        ``slot.ready`` before use)."""
        slot = self._slot_for(layer)
        if slot.revision != layer.revision():
            slot.present, slot.revision = set(), layer.revision()  # merged into: device copies are stale
        missing = [e for e in experts if e not in slot.present]
        factors = lora_tensors(layer.lora() if lora is None else lora)
        stale_lora = not self.lora_on_device and not self._lora_current(slot, factors)
        if not missing and not stale_lora:
            return slot
        host = layer.weights
        # Experts the cache holds come from device memory; only the rest cross PCIe.
        sources = {e: self.cache.take(layer.index, e, slot.revision) if self.cache is not None else None
                   for e in missing}
        runs = _runs(missing, sources)
        copied = sum(stop - start for start, stop, cached in runs if cached is None)
        with record_function("moecc.offload.copy_experts"):
            if self.copy_stream is None:
                start = time.perf_counter()
                if stale_lora:
                    self._stage_lora(slot, factors)
                _copy_runs(slot, host, runs, None)
                self.copy_s += time.perf_counter() - start
            else:
                with torch.cuda.stream(self.copy_stream):
                    begin = _timed_event(self.copy_stream)
                    if stale_lora:  # first: small, and the layer's compute needs them as soon as the weights
                        self._stage_lora(slot, factors)
                    _copy_runs(slot, host, runs, self.copy_stream, self.driver_copies)
                    slot.ready = _timed_event(self.copy_stream)
                    self._copy_events.add(begin, slot.ready)
        self.h2d_bytes += copied * (host.gate_up[0].nbytes + host.down[0].nbytes)
        self.experts_copied += copied
        slot.present.update(missing)
        return slot

    def place_lora(self, factors: list) -> None:
        """Puts expert LoRA factors (parameters) where this engine reads them: on the device under
        ``lora_on_device``, else pinned in host memory on CUDA. ``prepare`` places the adapters it creates; an
        adapter PEFT adds later (``add_adapter``, ``load_adapter``) starts in host memory and is placed at its
        layer's first call."""
        for tensor in factors:
            if tensor is None:
                continue
            if self.lora_on_device:
                if tensor.device != self.device:
                    tensor.data = tensor.data.to(self.device)
            elif self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
                tensor.data = tensor.data.pin_memory()

    def _lora_key(self, factors: list[torch.Tensor | None]) -> tuple:
        """The forward pass and the very host tensors (held, so their memory cannot pass to new ones) a slot's
        LoRA copies are made in and from."""
        return (self.forward_passes, *factors)

    def _lora_current(self, slot: _Slot, factors: list[torch.Tensor | None]) -> bool:
        """Whether the slot's device copies of ``factors`` are current: made from these tensors during this
        forward pass. Within a pass (forward, recomputations, backward) the factors do not change; between passes
        an optimizer may have written them, and a fused optimizer does so without bumping the tensors' version
        counters, so every pass copies them again (26 MB per Qwen3-30B-A3B layer, 2% of its expert weights)."""
        key = slot.lora_key
        return (key is not None and key[0] == self.forward_passes and len(key) == len(factors) + 1
                and all(held is given for held, given in zip(key[1:], factors)))

    def _stage_lora(self, slot: _Slot, factors: list[torch.Tensor | None]) -> None:
        """Copies the layer's expert LoRA factors to the device on the current stream (the copy stream on CUDA).

        Not on the compute stream: a host-to-device copy queued there waits behind the copy stream's transfer
        of the next layer's experts (one copy engine serves both), stalling the compute for up to a whole layer
        copy. Safe while the optimizer writes the host factors: the layer's compute waits for these copies, and
        its backward's blocking gradient copy to the host waits for that compute, before any optimizer step.
        """
        # copy=True: on the CPU too, so the slot's copies are checked for staleness there as on a GPU
        slot.lora = [None if t is None else t.detach().to(self.device, non_blocking=True, copy=True)
                     for t in factors]
        slot.lora_key = self._lora_key(factors)
        self.h2d_bytes += sum(t.nbytes for t in factors if t is not None)

    def device_lora(self, slot: _Slot, lora: tuple) -> tuple[ExpertLora | None, ExpertLora | None]:
        """The slot's device copies of ``lora`` (the layer's ``(gate_up, down)`` factors), or ``lora`` itself when
        the factors live on the device; call after :meth:`use`. On CUDA copies are marked as used by the current
        stream, so a later staging cannot reuse their memory before this stream has read them."""
        if self.lora_on_device:
            return lora
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        out = []
        for part, a, b in zip(lora, slot.lora[0::2], slot.lora[1::2]):
            if part is None:
                out.append(None)
                continue
            if current is not None:
                a.record_stream(current)
                b.record_stream(current)
            out.append(ExpertLora(a, b, part.scaling, part.num_experts))
        return tuple(out)

    def use(self, slot: _Slot) -> None:
        """Makes the current stream wait for the slot's copies; the stall is timed with events around it."""
        self._wait_for(slot.ready)

    def _wait_for(self, ready: torch.cuda.Event | None) -> None:
        if ready is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            before = _timed_event(stream)
            stream.wait_event(ready)
            self._wait_events.add(before, _timed_event(stream))

    def done_with(self, slot: _Slot) -> None:
        if self.device.type == "cuda":
            slot.released = torch.cuda.current_stream(self.device).record_event()

    def prefetch(self, index: int, experts: list[int] | None) -> None:
        """Starts copying layer ``index``'s experts (all when ``experts`` is None), if that layer exists."""
        if 0 <= index < len(self.layers) and self.capacity > 1:
            layer = self.layers[index]
            self.fetch(layer, experts if experts is not None else list(range(layer.weights.num_experts)))

    def keep_for_backward(self, call: _Call, saved: SavedState) -> SavedState | ParkedState | None:
        """What a layer's autograd node holds until its backward: nothing when no gradient will be asked for,
        else the state parked in host memory, or on the device for a recomputation (used at once)."""
        if not call.keep:
            return None
        if self.park_activations and not call.recompute:
            return self.parking.park(call.key, saved)
        return saved

    def unpark(self, state: SavedState | ParkedState) -> SavedState:
        """The saved state on the device, the current stream waiting (timed) for its copy back."""
        if not isinstance(state, ParkedState):
            return state
        saved, ready = self.parking.take(state)
        self._wait_for(ready)
        return saved


@dataclass(frozen=True)
class _Call:
    """How one forward call of a layer runs."""

    keep: bool  # a gradient may be asked for: keep the state backward needs
    recompute: bool  # run inside backward (a checkpointed layer's forward again)
    key: tuple[int, int]  # (forward pass, layer index), under which a parked state is prefetched


class OffloadLayer(ExpertLayer):
    """One MoE layer's routed experts, computed on the device from copied weights."""

    engine: OffloadEngine

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: OffloadEngine,
                 index: int) -> None:
        super().__init__(name, experts, wrappers, engine, index)
        self.last_experts: list[int] | None = None  # routed in the latest forward; backward prefetches them

    def backward_lock(self) -> contextlib.AbstractContextManager:
        """The engine's lock: the slots are shared, so one thread's layer call at a time."""
        return self.engine.lock

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        """Queues the layer's copies and compute on the device; ``result()`` hands the output over."""
        self.check_inputs(hidden, top_k_index, top_k_weights)
        # A host sync: which experts to copy, and their token counts; bad ids are refused before any slot changes
        counts = routed_counts(top_k_index, self.weights.num_experts)
        lora = self.lora()
        factors = lora_tensors(lora)
        engine = self.engine
        with engine.lock:
            engine.place_lora(factors)
            recompute = self.begin_call(hidden)
            keep = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (hidden, top_k_weights, *factors))
            call = _Call(keep, recompute, (engine.forward_passes, self.index))
            out = OffloadExpertsFunction.apply(hidden, top_k_weights, top_k_index, self, lora, call, counts, *factors)
        return self.checked(Ready(out))

    def device_weights(self, slot: _Slot) -> ExpertWeights:
        """The experts' weights as the slot holds them on the device (biases copied, being small)."""
        host = self.weights
        to = self.engine.device
        return ExpertWeights(
            slot.gate_up, slot.down,
            None if host.gate_up_bias is None else host.gate_up_bias.to(to, non_blocking=True),  # frozen
            None if host.down_bias is None else host.down_bias.to(to, non_blocking=True),
            host.transposed, host.interleaved, host.swiglu_alpha, host.swiglu_limit,
        )


class OffloadExpertsFunction(torch.autograd.Function):
    """Autograd node of one offloaded layer; backward copies the layer's experts again (prefetched), and its
    saved state back from host memory (prefetched with them)."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, token_counts, *lora_tensors):
        engine, num_experts = layer.engine, layer.weights.num_experts
        # Every expert when the slot holds them all (prefetched whole, as for every layer after the first when
        # batches are large), else the routed ones (``token_counts``, read on the host before the compute is
        # queued, so nothing waits for it).
        experts = (list(range(num_experts)) if engine.holds_all(layer)
                   else [e for e, count in enumerate(token_counts) if count])
        layer.last_experts = experts
        slot = engine.fetch(layer, experts)
        if not call.recompute:  # inside backward the engine prefetches the layers before, not after
            many = len(experts) * 2 >= num_experts
            engine.prefetch(layer.index + 1, None if many else [])  # next layer's routing is unknown: all or none
        engine.use(slot)
        begun = engine.compute_begins()
        device_lora = engine.device_lora(slot, lora)
        math = device_backend(engine.compute)  # backward uses the same, whatever compute is by then
        with record_function("moecc.offload.forward"):
            out, saved = math.forward(layer.device_weights(slot), hidden, top_k_index, top_k_weights,
                                              *device_lora)
        engine.done_with(slot)
        engine.compute_ends(begun, backward=False)
        if not call.recompute:
            engine.metrics.add_expert_counts(token_counts)
            if engine.cache is not None:
                engine.cache.observe(layer.index, token_counts)
        ctx.state = engine.keep_for_backward(call, saved)  # nothing else holds the saved tensors
        ctx.layer, ctx.lora, ctx.experts, ctx.math, ctx.key = layer, lora, experts, math, call.key
        ctx.dtypes = (hidden.dtype, top_k_weights.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.layer.checked_backward(grad_out, lambda: OffloadExpertsFunction._backward(ctx, grad_out))

    @staticmethod
    def _backward(ctx, grad_out):
        layer, engine, state = ctx.layer, ctx.layer.engine, ctx.state
        if state is None:
            raise saved_state_gone("offloaded")
        ctx.state = None
        slot = engine.fetch(layer, ctx.experts, ctx.lora)  # the factors forward used, whatever is active now
        if isinstance(state, ParkedState):
            engine.parking.restore(state)  # queued now unless the layer after prefetched it
        previous = engine.layers[layer.index - 1] if layer.index > 0 else None
        if previous is not None and getattr(previous, "last_experts", None) is not None:
            engine.prefetch(layer.index - 1, previous.last_experts)
        if previous is not None:
            engine.parking.prefetch((ctx.key[0], previous.index))
        engine.use(slot)
        saved = engine.unpark(state)
        begun = engine.compute_begins()
        device_lora = engine.device_lora(slot, ctx.lora)
        with record_function("moecc.offload.backward"):
            grad_hidden, grad_weights, grads = ctx.math.backward(layer.device_weights(slot), saved, grad_out,
                                                                 *device_lora)
        engine.done_with(slot)
        engine.compute_ends(begun, backward=True)
        return node_gradients(grad_hidden.to(ctx.dtypes[0]), grad_weights.to(ctx.dtypes[1]), 5, ctx.lora, grads)


OffloadEngine.layer_class = OffloadLayer


def pin_experts(experts: torch.nn.Module) -> None:
    """Moves one experts module's weights into page-locked host memory (the copies replace the originals)."""
    for param in experts.parameters(recurse=False):
        if not param.is_pinned():
            param.data = param.data.pin_memory()


def offload_gpu_bytes(layers: list, config: MoeccConfig, lora_on_device: bool) -> int:
    """What offload keeps on the GPU besides the non-expert weights: its slots, its cache, and with
    ``lora_on_device`` the expert LoRA factors, their gradients and two AdamW moments (4x the float32 factors)."""
    slot = max((layer.experts.gate_up_proj.nbytes + layer.experts.down_proj.nbytes for layer in layers), default=0)
    lora = 4 * sum(p.nbytes for p in expert_lora_params(layers)) if lora_on_device else 0
    return config.offload_slots * slot + cache_setting(None, config)[0] + lora


def cache_setting(device: torch.device | None, config: MoeccConfig) -> tuple[int, int | None]:
    """``(cache_bytes, cache_limit)`` for the engines from ``config.offload_cache_gb``: a fixed budget, or under
    ``"auto"`` none fixed and the limit the cache's sizing works within (the GPU budget, else the device memory free
    now plus what this process holds; 0 off CUDA, where host and device are one memory)."""
    if config.offload_cache_gb != "auto":
        return int(config.offload_cache_gb * 1e9), None
    if config.gpu_memory_budget_gb is not None:
        return 0, int(config.gpu_memory_budget_gb * 1e9)
    if device is None or device.type != "cuda":
        return 0, 0
    free, _ = torch.cuda.mem_get_info(device)  # other processes' memory is not ours to fill
    return 0, free + torch.cuda.memory_reserved(device)


def lora_on_device(model: torch.nn.Module, layers: list, device: torch.device, config: MoeccConfig) -> bool:
    """Whether offload keeps the expert LoRA factors on ``device`` (see ``MoeccConfig.offload_lora``). Under
    ``"auto"``: when the factors, their gradients and two AdamW moments (4x the float32 factors) take at most a
    quarter of the GPU budget (of the GPU's memory without one) and everything else that stays on the GPU still
    fits the budget beside them; always off CUDA, where host and device are one memory."""
    if config.offload_lora != "auto":
        return config.offload_lora == "device"
    if device.type != "cuda":
        return True
    state = 4 * sum(p.nbytes for p in expert_lora_params(layers))
    if config.gpu_memory_budget_gb is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return state <= torch.cuda.get_device_properties(index).total_memory / 4
    budget = config.gpu_memory_budget_gb * 1e9
    resident = resident_weight_bytes(model) + offload_gpu_bytes(layers, config, lora_on_device=True)
    return state <= budget / 4 and resident * BUDGET_SLACK <= budget
