"""Device slots: the part of the offload and hybrid paradigms that copies routed experts to the device.

Expert weights stay in host memory (pinned on CUDA), one copy. ``DeviceSlots`` holds a few layers' worth of device
copies (slots, LRU over layers), the copy stream they are filled on, the expert cache that fills them without
crossing PCIe (``moecc.paradigms.expert_cache``, sized by ``cache_sizing`` under ``offload_cache_gb="auto"``), the
device copies of the expert LoRA factors (or the factors themselves, under ``lora_on_device``), the parking of saved
states in host memory (``moecc.paradigms.parking``) and the copies' and waits' metrics. Engines hold one and call it;
it knows nothing of how a layer's experts are split.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.profiler import record_function

from ..config import MoeccConfig
from ..experts import ExpertLora, ExpertWeights, SavedState
from ..experts.select import default_device_backend, device_backend
from ..lora import lora_tensors
from .base import BUDGET_SLACK, StepMetrics, expert_lora_params, resident_weight_bytes
from .cache_sizing import CacheSizer
from .driver_copies import DriverCopies, run_copies
from .event_spans import EventSpans, timed_event
from .expert_cache import CudaPeakMemory, ExpertCache
from .parking import ActivationParking, ParkedState


@dataclass(frozen=True)
class Call:
    """How one forward call of a layer runs."""

    keep: bool  # a gradient may be asked for: keep the state backward needs
    recompute: bool  # run inside backward (a checkpointed layer's forward again)
    key: tuple[int, int]  # (forward pass, layer index), under which a parked state is prefetched

    @classmethod
    def begin(cls, layer, hidden: torch.Tensor, top_k_weights: torch.Tensor, factors: list) -> Call:
        """Begins a call of ``layer`` (``ExpertLayer.begin_call``: a recomputation or not) that keeps what backward
        needs where a gradient may be asked for: of the hidden states, the routing weights or a LoRA factor."""
        recompute = layer.begin_call(hidden)
        keep = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, top_k_weights, *factors))
        return cls(keep, recompute, (layer.engine.forward_passes, layer.index))


class Slot:
    """Device copies of one layer's experts; ``present`` says which experts hold valid data."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.layer: int | None = None
        self.revision: tuple = ()  # PEFT merge state the copies were made under
        self.present: set[int] = set()
        self.ready: torch.cuda.Event | None = None  # copies into the slot done
        self.released: torch.cuda.Event | None = None  # compute reading the slot done
        # Device copies of the layer's expert LoRA factors (``lora_tensors`` order), and the forward pass and host
        # tensors they were copied in and from (see ``DeviceSlots._lora_current``).
        self.lora: list[torch.Tensor | None] = []
        self.lora_key: tuple | None = None



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


def _copy_runs(slot: Slot, host: ExpertWeights, runs: list[tuple[int, int, tuple | None]],
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



class DeviceSlots:
    """Slots, copy stream, cache, LoRA copies and parking for one engine's ``layers`` (the engine's list, in model
    order). ``compute``: ``MoeccConfig.offload_compute``'s names (None: ``"auto"``). ``metrics``: the engine's, whose
    host-side expert seconds :meth:`compute_ends` adds to off CUDA; ``forward_passes``: the engine's pass counter."""

    def __init__(self, device: torch.device, layers: list, metrics: StepMetrics, forward_passes: Callable[[], int],
                 capacity: int = 2, compute: str | None = None, cache_bytes: int = 0,
                 cache_limit: int | None = None) -> None:
        self.device, self.layers, self.metrics, self._forward_passes = device, layers, metrics, forward_passes
        # Device copies of the hottest experts (moecc.paradigms.expert_cache); None when no budget is given.
        # With ``cache_limit`` (offload_cache_gb="auto") the budget follows each batch size's measured peak
        # (moecc.paradigms.cache_sizing), read through ``peak_memory`` (None off CUDA: the cache stays empty).
        auto = cache_limit is not None
        self.cache = ExpertCache(device, cache_bytes) if cache_bytes > 0 or auto else None
        self.cache_sizer = CacheSizer(cache_limit) if auto else None
        self.peak_memory = CudaPeakMemory(device) if auto and device.type == "cuda" else None
        # (tokens, training, cache bytes, backward_calls) of the pass running, at its start
        self._cache_pass: tuple[int, bool, int, int] | None = None
        self.capacity = max(1, capacity)
        self.compute = default_device_backend(device) if compute in (None, "auto") else compute
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.held: OrderedDict[int, Slot] = OrderedDict()
        # Park each layer's saved state in host memory between its forward and its backward (``parking``);
        # False keeps it on the device. On the CPU the same path runs with plain host copies.
        self.park_activations = True
        # Expert LoRA factors on the device already (MoeccConfig.offload_lora): used in place, never staged.
        self.lora_on_device = False
        self.parking = ActivationParking(device, self.copy_stream)
        self.driver_copies = DriverCopies(device) if device.type == "cuda" else None
        self.h2d_bytes = 0  # expert weights copied to the device
        self.experts_copied = 0  # of them, whole experts (hybrid's cost model times them)
        self.copy_s = 0.0  # measured directly where copies are synchronous (no CUDA)
        self._mark = (0, 0, 0)
        self._cache_mark = 0
        # CUDA event pairs: around each batch of copies on the copy stream, and around each wait of the compute
        # stream for a slot; read (and synchronised) only when metrics are asked for.
        self.copy_events = EventSpans()
        self._wait_events = EventSpans()
        self._compute_events = EventSpans()  # around each expert computation on the compute stream

    @property
    def compute(self) -> str:
        """Expert math on the device: ``"grouped"`` or ``"reference"`` (``MoeccConfig.offload_compute``)."""
        return self._compute

    @compute.setter
    def compute(self, value: str) -> None:
        device_backend(value, "compute")  # refuses unknown names, saying which exist
        self._compute = value

    def finish(self, model: torch.nn.Module, config: MoeccConfig, device_lora: bool = True) -> None:
        """Decides where the expert LoRA lives and puts the factors there (after ``keep_on_host`` moved the
        experts' subtree to host memory); ``device_lora`` False keeps it in host memory whatever the config."""
        self.lora_on_device = device_lora and lora_on_device(model, self.layers, self.device,
                                             replace(config, offload_slots=self.capacity))
        self.place_lora(expert_lora_params(self.layers))

    def pass_begins(self, tokens: int, training: bool, backward_calls: int) -> None:
        """A forward pass of ``tokens`` begins: the cache is sized (under ``"auto"``) and refilled from the routing
        of the passes so far. ``backward_calls``: the engine's layer backwards begun, by which the sizing knows
        whether the pass before had a backward."""
        if self.cache_sizer is not None:
            self._size_cache(tokens, training, backward_calls)
        if self.cache is not None:
            self.cache.refill(self.layers, self.copy_stream)
            if self.cache_sizer is not None:
                self._cache_pass = (tokens, training, self.cache.bytes, backward_calls)
                if self.peak_memory is not None:
                    self.peak_memory.reset()  # this pass's peak starts with its cache in place

    def _size_cache(self, tokens: int, training: bool, backward_calls: int) -> None:
        """Files the span of the pass before (up to now) with its peak, less its cache; gives the cache what a pass
        of ``tokens`` leaves."""
        if self._cache_pass is not None and self.peak_memory is not None:
            before, was_training, cache_bytes, calls_before = self._cache_pass
            self.cache_sizer.observe(before, self.peak_memory.peak(), cache_bytes,
                                     backward=backward_calls > calls_before, training=was_training)
        self.cache.resize(self.cache_sizer.budget(tokens, training))

    def gpu_bytes(self, config: MoeccConfig) -> int:
        """Device memory the slots, the cache and (under ``lora_on_device``) the expert LoRA state take."""
        return offload_gpu_bytes(self.layers, replace(config, offload_slots=self.capacity), self.lora_on_device)

    def budget_advice(self) -> str:
        return (" or lower offload_slots / offload_cache_gb"
                + (" or keep the expert LoRA in host memory (offload_lora='host')" if self.lora_on_device else ""))

    def reset_metrics(self) -> None:
        self.parking.reset_metrics()
        self._mark = (self.h2d_bytes, self.parking.bytes_to_device, self.parking.bytes_to_host)
        self._cache_mark = self.cache.hits if self.cache is not None else 0
        self.copy_s = 0.0
        for spans in (self.copy_events, self._wait_events, self._compute_events):
            spans.reset()
    def compute_begins(self) -> tuple:
        """Marks the start of expert math on the compute stream; pass the result to :meth:`compute_ends`."""
        event = timed_event(torch.cuda.current_stream(self.device)) if self.device.type == "cuda" else None
        return time.perf_counter(), event

    def compute_ends(self, begun: tuple, backward: bool) -> None:
        """Adds the expert math's time: GPU time between events on CUDA, wall time elsewhere."""
        start, event = begun
        if event is not None:
            self._compute_events.add(event, timed_event(torch.cuda.current_stream(self.device)))
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
        copy_s = (self.copy_s + parking.to_device_s + self.copy_events.seconds()
                  + parking.to_device_events.seconds())
        return {"cpu_experts_s": 0.0, "h2d_gb": h2d / 1e9, "d2h_gb": (parking.bytes_to_host - parked_mark) / 1e9,
                "gpu_wait_s": m.wait_s + self._wait_events.seconds(), "tokens": float(m.tokens),
                "routing_skew": m.routing_skew, "copy_s": copy_s,
                "d2h_s": parking.to_host_s + parking.to_host_events.seconds(),
                "expert_compute_s": m.cpu_forward_s + m.cpu_backward_s + self._compute_events.seconds(),
                "cache_hits": float(self.cache.hits - self._cache_mark) if self.cache is not None else 0.0,
                "cache_gb": self.cache.bytes / 1e9 if self.cache is not None else 0.0}

    def _slot_for(self, layer) -> Slot:
        if layer.index in self.held:
            self.held.move_to_end(layer.index)
            return self.held[layer.index]
        host = layer.weights
        if len(self.held) < self.capacity:
            slot = Slot(torch.empty(host.gate_up.shape, dtype=host.gate_up.dtype, device=self.device),
                         torch.empty(host.down.shape, dtype=host.down.dtype, device=self.device))
        else:
            _, slot = self.held.popitem(last=False)
            if slot.gate_up.shape != host.gate_up.shape or slot.gate_up.dtype != host.gate_up.dtype:
                slot = Slot(torch.empty_like(host.gate_up, device=self.device),
                             torch.empty_like(host.down, device=self.device))
            elif slot.released is not None and self.copy_stream is not None:
                self.copy_stream.wait_event(slot.released)  # the last reader of this slot must finish first
        slot.layer, slot.present, slot.ready = layer.index, set(), None
        self.held[layer.index] = slot
        return slot

    def holds_all(self, layer) -> bool:
        """Whether the layer's slot has (or is being sent) every expert, as of the current merge state."""
        slot = self.held.get(layer.index)
        return (slot is not None and slot.revision == layer.revision()
                and len(slot.present) == layer.weights.num_experts)

    def fetch(self, layer, experts: list[int], lora: tuple | None = None) -> Slot:
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
                    begin = timed_event(self.copy_stream)
                    if stale_lora:  # first: small, and the layer's compute needs them as soon as the weights
                        self._stage_lora(slot, factors)
                    _copy_runs(slot, host, runs, self.copy_stream, self.driver_copies)
                    slot.ready = timed_event(self.copy_stream)
                    self.copy_events.add(begin, slot.ready)
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
        return (self._forward_passes(), *factors)

    def _lora_current(self, slot: Slot, factors: list[torch.Tensor | None]) -> bool:
        """Whether the slot's device copies of ``factors`` are current: made from these tensors during this
        forward pass. Within a pass (forward, recomputations, backward) the factors do not change; between passes
        an optimizer may have written them, and a fused optimizer does so without bumping the tensors' version
        counters, so every pass copies them again (26 MB per Qwen3-30B-A3B layer, 2% of its expert weights)."""
        key = slot.lora_key
        return (key is not None and key[0] == self._forward_passes() and len(key) == len(factors) + 1
                and all(held is given for held, given in zip(key[1:], factors)))

    def _stage_lora(self, slot: Slot, factors: list[torch.Tensor | None]) -> None:
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

    def device_lora(self, slot: Slot, lora: tuple) -> tuple[ExpertLora | None, ExpertLora | None]:
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

    def use(self, slot: Slot) -> None:
        """Makes the current stream wait for the slot's copies; the stall is timed with events around it."""
        self._wait_for(slot.ready)

    def _wait_for(self, ready: torch.cuda.Event | None) -> None:
        if ready is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            before = timed_event(stream)
            stream.wait_event(ready)
            self._wait_events.add(before, timed_event(stream))

    def done_with(self, slot: Slot) -> None:
        if self.device.type == "cuda":
            slot.released = torch.cuda.current_stream(self.device).record_event()

    def prefetch(self, index: int, experts: list[int] | None) -> None:
        """Starts copying layer ``index``'s experts (all when ``experts`` is None), if that layer exists."""
        if 0 <= index < len(self.layers) and self.capacity > 1:
            layer = self.layers[index]
            self.fetch(layer, experts if experts is not None else list(range(layer.weights.num_experts)))

    def keep_for_backward(self, call: Call, saved: SavedState) -> SavedState | ParkedState | None:
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


    def fetch_measured(self, layer, experts: list[int], lora: tuple | None = None) -> tuple[Slot, int, object]:
        """:meth:`fetch`, and how many whole experts crossed PCIe for it with their timing: a ``(begin, end)``
        event pair on CUDA, else seconds (nothing copied: 0 and None)."""
        before_experts, before_events, before_s = self.experts_copied, self.copy_events.added, self.copy_s
        slot = self.fetch(layer, experts, lora)
        copied = self.experts_copied - before_experts
        if not copied:
            return slot, 0, None
        return slot, copied, (self.copy_events.last() if self.copy_events.added > before_events
                              else self.copy_s - before_s)

    def present(self, layer) -> set[int]:
        """Experts of ``layer`` its slot holds current copies of (or is being sent)."""
        slot = self.held.get(layer.index)
        return set(slot.present) if slot is not None and slot.revision == layer.revision() else set()

    def cached(self, layer) -> set[int]:
        """Experts of ``layer`` the expert cache holds current copies of: on the GPU without crossing PCIe."""
        if self.cache is None:
            return set()
        revision = layer.revision()
        return {e for e in range(layer.weights.num_experts) if self.cache.holds(layer.index, e, revision)}

    def device_weights(self, layer, slot: Slot) -> ExpertWeights:
        """``layer``'s experts' weights as ``slot`` holds them on the device (biases copied, being small)."""
        host = layer.weights
        to = self.device
        return ExpertWeights(
            slot.gate_up, slot.down,
            None if host.gate_up_bias is None else host.gate_up_bias.to(to, non_blocking=True),  # frozen
            None if host.down_bias is None else host.down_bias.to(to, non_blocking=True),
            host.transposed, host.interleaved, host.swiglu_alpha, host.swiglu_limit,
        )


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
