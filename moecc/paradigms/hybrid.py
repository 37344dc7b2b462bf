"""Hybrid paradigm: in every MoE layer pass the GPU computes the hot experts from copied weights while the CPU
computes the cold ones in place, both at once; the layer's output and every gradient are the two parts' sums.

Forward, layer i: the router's counts come to the host (one sync, which the CPU side needs anyway). Every routed
expert whose weights are in layer i's device slot runs on the GPU (``moecc.experts`` subset, sized from those
counts: no second sync);
every other routed expert runs on the CPU (the native kernels, on a worker thread). The slot was filled a layer
ahead from a forecast of layer i's routing (recent passes, ``RoutingForecast``), planned by ``plan_split`` to
balance CPU seconds against copy and GPU seconds; layer i's forward queues layer i+1's copies the same way.
Backward, where routing is known from forward: each layer runs its forward's split (each side holds its own saved
state), plus, where ``backward_split`` finds it pays, some of the forward's CPU experts on the GPU: it recomputes
the forward of all its experts, those and its own, from the hidden states its part saved, and the CPU drops them
from its state (``keep_experts``).
Layer i's backward prefetches layer i-1's GPU experts and parked activations.

One set of LoRA factors: on the GPU where they fit (the CPU part reads pinned host mirrors, copied once per pass),
else host parameters read in place by the CPU and copied to the device once per pass; their gradient is the sum of
both sides' (each zero outside its experts). The split's costs start from the
machine's rates and follow what each pass measures while both sides run (``CostTracker``).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch
from torch.profiler import record_function

from .. import _ops
from ..config import MoeccConfig
from ..experts import ExpertBackend, ExpertLora, LoraGrads, SavedState
from ..experts.grouping import group_by_expert
from ..experts.select import cpu_backend, default_device_backend, device_backend
from ..lora import lora_tensors
from ..staging import StagingBuffers
from .base import (Pending, Worker, current_graph_task, expert_lora_params, node_gradients, routed_counts,
                   saved_state_gone)
from .device_wait import CpuDone
from .hybrid_parts import (_add, _add_part, _backward_publish_target, _cpu_backward, _cpu_backward_published,
                           _cpu_forward, _cpu_forward_published, _cpu_sources, _mask, _publish_target)
from .hybrid_split import CostTracker, RoutingForecast, SideCosts, hit_rate, physical_costs, plan_split
from .step_guard import GPU, SPLIT, StepGuard, size_bucket
from .event_spans import EventSpans
from .offload import (OffloadEngine, OffloadLayer, ParkedState, _Call, _timed_event, cache_setting,
                      lora_on_device, offload_gpu_bytes)

_KEPT_ERRORS = 16  # backward parts' errors kept for passes that have not claimed them
_PASSES_KEPT = 1024  # forward passes whose sizes are kept for their backwards' gaps (micro-batches before them)
# Split hook: (layer index, tokens per expert, "forward") -> the experts to run on the GPU.
SplitRule = Callable[[int, list, str], Iterable[int]]


@dataclass
class SideMetrics:
    """Per-side counters since the last reset (seconds, experts and routed pairs; forward and backward)."""

    cpu_s: float = 0.0
    cpu_experts: int = 0
    cpu_pairs: int = 0
    gpu_experts: int = 0
    gpu_pairs: int = 0
    cpu_wait_s: float = 0.0  # the caller blocked on the CPU part (forward result, backward join)
    layer_passes: int = 0
    both_sides: int = 0  # layer passes that ran on both sides
    prefetch_hits: float = 0.0  # summed over forwards: the share of their pairs the prefetch put on the GPU
    prefetched_forwards: int = 0
    device_waits: int = 0  # forwards whose CPU part the device waited for itself (CpuDone), the host going on
    backward_device_waits: int = 0  # the same for backwards
    moved_experts: int = 0  # experts whose forward ran on the CPU and whose backward runs on the GPU
    cold_cpu_parts: int = 0  # CPU parts during which the backend's buffer pools grew (not fitted)
    gpu_only_steps: int = 0  # training steps the step guard ran with every expert on the GPU


class HybridEngine(OffloadEngine):
    """Offload's device slots, copy stream and parking for the GPU part, plus co-compute's staging, worker and
    CPU backend for the CPU part, and the split's forecast and costs."""

    name = "hybrid"

    def __init__(self, device: torch.device, cpu: ExpertBackend, slots: int = 2, compute: str | None = None,
                 cache_bytes: int = 0, cache_limit: int | None = None) -> None:
        super().__init__(device, max(2, slots), compute, cache_bytes, cache_limit)
        self.cpu = cpu
        self.staging = StagingBuffers(self.device)  # offload's: numbered ("cuda" as "cuda:0")
        self.worker = Worker("moecc-hybrid-cpu")
        self.forecast = RoutingForecast()
        self.trackers: dict[str, CostTracker] | None = None  # per pass; made in finish, from the first layer's shape
        self.split_rule: SplitRule | None = None  # tests and experiments: force the GPU set per layer pass
        # Whole steps with the splits against every expert on a CUDA GPU, per batch size (None: the splits always;
        # the CPU device standing in for a GPU has no link whose time a split saves)
        self.step_guard: StepGuard | None = (StepGuard(_seconds_between, done=_mark_done)
                                             if self.device.type == "cuda" else None)
        self.step_mode = SPLIT  # this pass's: the planner's splits, or every routed expert on the GPU
        self.planned: dict[int, tuple[int, ...]] = {}  # layer -> GPU experts its forward prefetch planned
        self.sides = SideMetrics()
        self._cpu_seen: set[tuple[str, int]] = set()  # (pass, layer) with a CPU part measured
        # Timelines set a list: (pass, layer, "submitted" | "started" | "computed" | "done", Unix ns) of each CPU
        # part, for its lane and the chain between one layer's part and the next's
        self.cpu_marks: list | None = None
        self._bytes_mark_staging = (0, 0)
        self.measure_lock = threading.Lock()  # the worker's CPU timings against the caller's reads and resets
        self._copy_samples: list[tuple[str, int, object]] = []  # (pass, experts copied, (begin, end) | seconds)
        # The GPU's work between one layer's experts and the next's (SideCosts.serial_s): phase -> (layer, forward
        # pass, mark) of the gap open now, and (phase, forward pass, begin, end) of the gaps measured, read at the
        # next pass; a backward's gaps are its forward pass's (another pass may begin in between: a reference
        # model's forward, a second micro-batch)
        self._gap_open: dict[str, tuple[int, int, object]] = {}
        self._copied_this_pass: dict[int, set[int]] = {}  # layer -> experts its slot got in this forward pass
        self._gap_samples: list[tuple[str, int, object, object]] = []
        # Forward pass -> (batch-size bucket, whether every expert ran on the GPU: its gaps are not a split's), for
        # the last passes; (phase, bucket) whose first pass with gaps came (buffers grow, kernels load: not taken)
        self._passes: dict[int, tuple[int, bool]] = {}
        self._gaps_seen: set[tuple[str, int]] = set()
        self._size = 0  # this pass's batch-size bucket
        # Device-resident LoRA factors: the CPU part reads host mirrors, copied once per pass on their own stream.
        self.mirror_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._mirrors: dict[int, tuple[list, list[torch.Tensor]]] = {}  # layer -> (factors, pinned host copies)
        self.cpu_done = CpuDone(self.device)
        self._cpu_wait_events = EventSpans()  # around each wait of the compute stream for a CPU part (CpuDone)
        self._deferred = threading.local()  # .parts: this thread's forwards whose CPU part is not joined yet
        # Backwards' CPU parts the device waits for itself, not joined yet (any thread's): (graph task, future); the
        # errors of joined ones, kept for their pass (graph task) to raise
        self._backward_parts: list[tuple[int, Future]] = []
        self._backward_errors: dict[int, BaseException] = {}
        self._backward_parts_lock = threading.Lock()
        self.first_backward_pass: int | None = None  # forward_passes when a backward first ran

    @classmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> HybridEngine:
        if config.num_threads is None and device.type == "cuda":
            configure_cpu_threads(config.pin_threads)
        compute = config.offload_compute
        return cls(device, cpu_backend(config.backend, config.isa, prepack=config.prepack_weights),
                   config.offload_slots, default_device_backend(device) if compute == "auto" else compute,
                   *cache_setting(device, config))

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        """Expert LoRA on the GPU where it fits (offload's rule: the optimizer steps it there and the GPU part uses
        it in place; the CPU part reads a host mirror), else in host memory with a device copy per pass."""
        self.lora_on_device = self.device.type == "cuda" and lora_on_device(model, self.layers, self.device,
                                                                            self._slots_config(config))
        self.place_lora(expert_lora_params(self.layers))
        self.cpu.prepare_layers([layer.weights for layer in self.layers])
        if self.trackers is None and self.layers:
            self.trackers = new_trackers(self)

    def gpu_bytes(self, config: MoeccConfig) -> int:
        return offload_gpu_bytes(self.layers, self._slots_config(config), self.lora_on_device)

    def _slots_config(self, config: MoeccConfig) -> MoeccConfig:
        """``config`` with the slots this engine allocates (at least two, one ahead: ``offload_slots=1`` gets two)."""
        return replace(config, offload_slots=self.capacity)

    def budget_advice(self) -> str:
        return (" or lower offload_slots / offload_cache_gb"
                + (" or keep the expert LoRA in host memory (offload_lora='host')" if self.lora_on_device else ""))

    def host_lora(self, index: int, lora: tuple) -> tuple[tuple, torch.cuda.Event | None]:
        """The factors as the CPU part reads them: ``lora`` itself in host memory, else layer ``index``'s pinned
        mirrors, copied after the work queued so far (the last optimizer step), and the event they are ready at."""
        if not any(part is not None and part.A.device.type == "cuda" for part in lora):
            return lora, None
        sources = [t for t in lora_tensors(lora) if t is not None]
        factors = [t.detach() for t in sources]
        held = self._mirrors.get(index)
        # Reused only for the very factor tensors they were made from (an optimizer writes those in place between
        # passes): another adapter's factors get buffers of their own, so a graph of the first still reads its own.
        if held is None or len(held[0]) != len(sources) or any(a is not b for a, b in zip(held[0], sources)):
            held = self._mirrors[index] = (sources, [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                                     for t in factors])
        mirrors = held[1]
        self.mirror_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.mirror_stream):
            for mirror, factor in zip(mirrors, factors):
                mirror.copy_(factor, non_blocking=True)
            ready = self.mirror_stream.record_event()
        it = iter(mirrors)
        host = tuple(None if part is None else ExpertLora(next(it), next(it), part.scaling, part.num_experts)
                     for part in lora)
        return host, ready

    def pass_begins(self, tokens: int, training: bool = True) -> None:
        super().pass_begins(tokens, training)
        self._copied_this_pass = {}
        self._learn_copy_rates()
        self.step_mode = SPLIT
        if self.step_guard is not None and self.split_rule is None:
            self.step_mode = self.step_guard.step_begins(tokens, self._stream_mark(), training)
            self.sides.gpu_only_steps += self.step_mode == GPU and training
        self._size = size_bucket(tokens)
        # A pass with every expert on the GPU measures the GPU's share of the gap alone, not a split's
        self._passes[self.forward_passes] = (self._size, self.step_mode == GPU)
        self._passes.pop(self.forward_passes - _PASSES_KEPT, None)  # passes are numbered one by one

    def wait_for_cpu_part(self, number: int) -> None:
        """Until CPU part ``number`` is published: on the device's stream where it can (this thread goes on), the
        stall timed with events around it (``device_cpu_wait_s``); else here, timed as the host's (``cpu_wait_s``)."""
        stream = torch.cuda.current_stream(self.device) if self.cpu_done.on_device else None
        before = _timed_event(stream) if stream is not None else None
        start = time.perf_counter()
        self.cpu_done.wait(number)
        if before is not None and self.cpu_done.on_device:
            after = _timed_event(stream)
            self._cpu_wait_events.add(before, after)
        else:
            self.sides.cpu_wait_s += time.perf_counter() - start

    def costs(self, phase: str) -> SideCosts:
        """The costs ``phase``'s splits are planned with."""
        with self.measure_lock:
            return self.trackers[phase].costs(self._size)

    def record_cpu(self, phase: str, index: int, counts: list[int], seconds: float, began_ns: int,
                   cold: bool = False) -> None:
        """One CPU part's seconds, from the worker: the metrics, the cost fit and a timeline's span. A layer's
        first CPU part of each pass kind is not fitted, nor a ``cold`` one (the backend's buffer pools grew during
        it): both paid page faults of first touch that the next parts do not, and a fit that learnt them kept the
        CPU out of the splits of a whole step or more (a new batch size grows the pools again)."""
        with self.measure_lock:
            if self.cpu_marks is not None:
                self.cpu_marks += [(phase, index, "started", began_ns),
                                   (phase, index, "computed", began_ns + int(seconds * 1e9))]
            self.sides.cpu_s += seconds
            self.sides.cold_cpu_parts += cold
            first = (phase, index) not in self._cpu_seen
            self._cpu_seen.add((phase, index))
            if self.trackers is not None and not first and not cold:
                self.trackers[phase].observe(counts, seconds, 0, 0.0)

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._cpu_wait_events.reset()
        with self.measure_lock:
            self.sides = SideMetrics()
        self._bytes_mark_staging = (self.staging.bytes_to_device, self.staging.bytes_to_host)

    def counters_since_reset(self) -> dict[str, float]:
        """Offload's keys (``copy_s``, ``gpu_wait_s``, ...) plus each side's work: ``cpu_experts_s`` (CPU seconds),
        ``cpu_experts`` / ``gpu_experts`` and ``cpu_pairs`` / ``gpu_pairs`` (summed over layer passes),
        ``cpu_wait_s``, ``both_sides_share`` (layer passes split between both sides), ``device_wait_share`` (of them,
        forwards whose CPU part the device waited for on its own: ``CpuDone``), ``backward_device_wait_share`` (the
        same for backwards), ``moved_experts`` (CPU experts in forward whose backward ran on the GPU, summed),
        ``cold_cpu_parts`` (CPU parts during which the backend's buffer pools grew, left out of the cost fit),
        ``gpu_only_steps`` (training steps the step guard ran with every expert on the GPU), ``prefetch_hit_rate``
        and the cost model's measured ``cpu_slowdown`` / ``copy_slowdown`` (measured over predicted seconds). The waits:
        ``copy_wait_s`` (the device stalled for copies: offload's ``gpu_wait_s``), ``device_cpu_wait_s`` (the
        device stalled for CPU parts it waited for itself, ``CpuDone``), ``cpu_wait_s`` (the host blocked on CPU
        parts) and ``gpu_wait_s``, their sum."""
        out = super().counters_since_reset()
        s = self.sides
        mark = self._bytes_mark_staging
        device_cpu_wait_s = self._cpu_wait_events.seconds()
        out.update({
            "copy_wait_s": out["gpu_wait_s"], "device_cpu_wait_s": device_cpu_wait_s,
            "gpu_wait_s": out["gpu_wait_s"] + device_cpu_wait_s + s.cpu_wait_s,
            "cpu_experts_s": s.cpu_s, "cpu_experts": float(s.cpu_experts), "gpu_experts": float(s.gpu_experts),
            "cpu_pairs": float(s.cpu_pairs), "gpu_pairs": float(s.gpu_pairs), "cpu_wait_s": s.cpu_wait_s,
            "both_sides_share": s.both_sides / s.layer_passes if s.layer_passes else 0.0,
            "prefetch_hit_rate": s.prefetch_hits / s.prefetched_forwards if s.prefetched_forwards else 0.0,
            "device_wait_share": s.device_waits / s.layer_passes if s.layer_passes else 0.0,
            "backward_device_wait_share": s.backward_device_waits / s.layer_passes if s.layer_passes else 0.0,
            "moved_experts": float(s.moved_experts), "cold_cpu_parts": float(s.cold_cpu_parts),
            "gpu_only_steps": float(s.gpu_only_steps),
            "cpu_slowdown": self.trackers["forward"].cpu_scale if self.trackers else 1.0,
            "copy_slowdown": self.trackers["forward"].copy_scale if self.trackers else 1.0,
        })
        out["h2d_gb"] += (self.staging.bytes_to_device - mark[0]) / 1e9
        out["d2h_gb"] += (self.staging.bytes_to_host - mark[1]) / 1e9
        return out

    def forward_split(self, layer: HybridLayer, counts: list[int]) -> tuple[int, ...]:
        """The experts layer ``layer`` runs on the GPU in this forward: the rule's when one is set; else the plan
        for these very counts with the experts already in the slot (prefetched from the forecast) on the GPU and
        their copies charged to this layer, so a routed expert the forecast missed is copied now only where that
        beats running it on the CPU beside them (cached experts cost no copy)."""
        if self.split_rule is not None:
            return tuple(sorted({int(e) for e in self.split_rule(layer.index, counts, "forward")}))
        if self.step_mode == GPU:
            return tuple(e for e, n in enumerate(counts) if n > 0)
        present = self._present(layer)
        copied = self._copied_this_pass.get(layer.index, set()) & present
        # What the slot still holds from an earlier pass (the last backward's copies) cost this pass nothing.
        return plan_split(counts, self.costs("forward"), resident=self._cached(layer) | (present - copied),
                          committed=copied, then=self.costs("backward")).gpu

    def backward_split(self, layer: HybridLayer, counts: list[int], gpu: tuple[int, ...]) -> tuple[int, ...]:
        """The experts layer ``layer``'s backward will run on the GPU after a forward that ran ``gpu`` there:
        those, plus CPU experts whose backward pays on the GPU (the CPU's backward costs about twice its forward,
        the copies the same), which the GPU recomputes from the hidden states its own part saved. Only where the
        GPU part has pairs (its saved hidden states) and the CPU backend can drop experts from its saved state."""
        if not any(counts[e] for e in gpu if e < len(counts)) or not hasattr(self.cpu, "keep_experts"):
            return gpu
        if self.split_rule is not None:
            chosen = {int(e) for e in self.split_rule(layer.index, counts, "backward")}
        else:
            chosen = set(plan_split(counts, self.costs("backward"), resident=self._cached(layer), required=gpu,
                                    recompute=self.costs("forward")).gpu)
        return tuple(sorted(chosen | set(gpu)))

    def _cached(self, layer: HybridLayer) -> set[int]:
        """Experts of ``layer`` the expert cache holds current copies of: on the GPU without crossing PCIe."""
        if self.cache is None:
            return set()
        revision = layer.revision()
        return {e for e in range(layer.weights.num_experts) if self.cache.holds(layer.index, e, revision)}

    def _present(self, layer: HybridLayer) -> set[int]:
        slot = self.slots.get(layer.index)
        return set(slot.present) if slot is not None and slot.revision == layer.revision() else set()

    @property
    def prefetch_depth(self) -> int:
        """Layers whose experts are copied ahead of the one computing: every slot but its own. One layer ahead
        leaves the copy engine idle whenever a layer's CPU part outlasts the next layer's copies."""
        return self.capacity - 1

    def prefetch_forward(self, index: int) -> None:
        """Queues layer ``index``'s forecast GPU experts (after this layer's own copies)."""
        if not 0 <= index < len(self.layers) or self.split_rule is not None:
            return
        expected = self.forecast.expected(index)
        if expected is None:
            return
        # Below half a token the forecast is an expert the recent passes stopped routing to, not a CPU part's cost.
        expected = [n if n >= 0.5 else 0.0 for n in expected]
        plan = (tuple(e for e, n in enumerate(expected) if n > 0) if self.step_mode == GPU else
                plan_split(expected, self.costs("forward"), resident=self._cached(self.layers[index]),
                           then=self.costs("backward")).gpu)
        self.planned[index] = plan
        if plan:
            self._timed_fetch("forward", self.layers[index], list(plan))

    def _timed_fetch(self, phase: str, layer: HybridLayer, experts: list[int], lora: tuple | None = None):
        """``fetch``, remembering how many experts crossed PCIe and how long that took, for the cost tracker."""
        before_experts, before_events, before_s = self.experts_copied, self._copy_events.added, self.copy_s
        if phase == "forward":
            held = self._present(layer)
            self._copied_this_pass.setdefault(layer.index, set()).update(e for e in experts if e not in held)
        slot = self.fetch(layer, experts, lora)
        copied = self.experts_copied - before_experts
        if copied:
            timing = self._copy_events.last() if self._copy_events.added > before_events else self.copy_s - before_s
            self._copy_samples.append((phase, copied, timing))
        return slot

    def _stream_mark(self):
        """A point in the compute stream's time: a CUDA event, or the clock where work is synchronous."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def gap_begins(self, phase: str, index: int, forward_pass: int | None) -> None:
        """Layer ``index``'s experts are done in this ``phase`` pass (their output summed); ``forward_pass``: the
        forward pass it is (a backward: the one it differentiates), None where that is not known (a recomputed
        layer's backward): no gap is taken."""
        if forward_pass is None:
            self._gap_open.pop(phase, None)
        else:
            self._gap_open[phase] = (index, forward_pass, self._stream_mark())

    def gap_ends(self, phase: str, index: int, forward_pass: int | None) -> None:
        """Layer ``index``'s experts' inputs are ready; the gap since the layer before in this pass is a sample."""
        opened = self._gap_open.pop(phase, None)
        if opened is not None and opened[0] + (1 if phase == "forward" else -1) == index and opened[1] == forward_pass:
            self._gap_samples.append((phase, forward_pass, opened[2], self._stream_mark()))

    def gap_interrupted(self, phase: str) -> None:
        """Drops the ``phase`` gap open now: other layer work ran inside it (a checkpointed layer's recomputed
        forward, CPU part and all, within the backward's gap), which the split's cost does not depend on."""
        self._gap_open.pop(phase, None)

    def _learn_copy_rates(self) -> None:
        """Feeds the copy timings and gaps since the last call (complete by now) to the cost trackers, each pass's
        gaps at once for its batch size; each phase's first pass with gaps at a batch size is dropped (its buffers
        grow, its kernels load: a chain the estimate would keep for steps)."""
        samples, self._copy_samples = self._copy_samples, []
        gaps, self._gap_samples = self._gap_samples, []
        self._gap_open.clear()
        if self.trackers is None:
            return
        passes: dict[tuple[str, int], list[float]] = {}
        for phase, forward_pass, begin, end in gaps:
            passes.setdefault((phase, forward_pass), []).append(_seconds_between(begin, end))
        for (phase, forward_pass), seconds in passes.items():
            size, gpu_only = self._passes.get(forward_pass, (0, True))
            first = (phase, size) not in self._gaps_seen
            self._gaps_seen.add((phase, size))
            if not gpu_only and not first:
                with self.measure_lock:
                    self.trackers[phase].observe_serial(seconds, size)
        for phase, experts, timing in samples:  # long done: the layer's compute waited for them
            seconds = timing if isinstance(timing, float) else _seconds_between(*timing)
            with self.measure_lock:
                self.trackers[phase].observe((), 0.0, experts, seconds)

    def run_cpu(self, fn, *args, mark: tuple[str, int] | None = None) -> Future:
        """``fn(*args)`` on the CPU part's worker; ``mark`` (pass, layer) names it in ``cpu_marks``."""
        marks = self.cpu_marks
        if marks is None or mark is None:
            return self.worker.submit(fn, *args)
        marks.append((*mark, "submitted", time.time_ns()))

        def marked():
            try:
                return fn(*args)
            finally:
                marks.append((*mark, "done", time.time_ns()))
        return self.worker.submit(marked)

    def defer(self, layer_index: int, parts: _Parts) -> None:
        """The CPU part of layer ``layer_index``'s ``parts`` is joined by this thread's next layer call
        (:meth:`join_deferred`), not now."""
        if not hasattr(self._deferred, "parts"):
            self._deferred.parts = []
        self._deferred.parts.append((layer_index, parts))

    def join_deferred(self, layer_index: int) -> None:
        """Waits for the CPU parts whose results the device waited for on its own (this thread's earlier layer
        calls) and raises the first error of those before layer ``layer_index``: the pass whose outputs used
        them must not go on. Called before a layer call changes any state, so a failed part leaves the model as
        usable as before. Parts of layers at or after ``layer_index`` are of a pass that ended without reaching
        the next layer (an error between the layers): joined, their errors dropped with that pass."""
        pending = getattr(self._deferred, "parts", None)
        if not pending:
            return
        self._deferred.parts = []
        start, error = time.perf_counter(), None
        for index, parts in pending:
            try:
                join_part(parts)
            except BaseException as caught:  # every part is joined before the first error is raised
                if index < layer_index:
                    error = error or caught
        self.sides.cpu_wait_s += time.perf_counter() - start
        if error is not None:
            raise error

    def defer_backward(self, future: Future) -> None:
        """A backward's CPU part that the device will wait for itself, registered as soon as it is submitted: joined
        by the next backward layer call, a forward, or the end of the backward pass running now, whose
        ``backward()`` then raises its error (:meth:`join_backward`). Outside the autograd engine's backward (a
        node's backward called directly) nothing publishes (``_backward_publish_target``)."""
        with self._backward_parts_lock:
            self._backward_parts.append((current_graph_task(), future))
        torch.autograd.Variable._execution_engine.queue_callback(self.join_backward)

    def join_backward(self) -> None:
        """Waits for every backward CPU part not joined yet; raises the first error of the calling thread's
        backward pass among them. The others' errors are kept for their own passes: a forward, or another thread's
        backward, never takes them. A pass that died raised already and never claims its parts' errors; those
        kept are bounded. Under the engine's lock throughout: a pass's end must not find its parts taken by another
        thread's join that has not filed their errors yet."""
        with self.lock:
            self._join_backward(current_graph_task())

    def _join_backward(self, task: int) -> None:
        with self._backward_parts_lock:
            pending, self._backward_parts = self._backward_parts, []
        start = time.perf_counter()
        for owner, future in pending:
            try:
                future.result()
            except BaseException as caught:  # every part is joined before an error is raised
                with self._backward_parts_lock:
                    self._backward_errors.setdefault(owner, caught)
                    while len(self._backward_errors) > _KEPT_ERRORS:
                        self._backward_errors.pop(next(iter(self._backward_errors)))
        if pending:
            with self.measure_lock:
                self.sides.cpu_wait_s += time.perf_counter() - start
        if task != -1:
            with self._backward_parts_lock:
                error = self._backward_errors.pop(task, None)
            if error is not None:
                raise error


def _seconds_between(begin, end) -> float:
    """Seconds from mark ``begin`` to mark ``end`` (``HybridEngine._stream_mark``: host clock readings, or CUDA
    timing events, waited for here)."""
    if isinstance(end, float):
        return end - begin
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _differentiated_pass(call: _Call) -> int | None:
    """The forward pass a layer call's backward differentiates; None for a recomputed call (numbered when the
    backward recomputed it, after any pass that began since)."""
    return None if call.recompute else call.key[0]


def _mark_done(mark) -> bool:
    """Whether the device has passed mark ``mark`` (a clock reading has)."""
    return isinstance(mark, float) or mark.query()


def configure_cpu_threads(pin_threads: bool = True) -> int:
    """Hybrid's native pool on a GPU machine: all CPUs but two, which are left to the threads that queue the GPU
    work and drive the copies (with every core in the pool the CPU kernels ran 2.2x slower while PCIe streamed,
    benchmarks/results/README.md). Returns the pool's threads."""
    pool = max(1, _ops.available_cpus() - 2)
    _ops.configure_pool(pool, pin_threads)
    return pool


def default_costs(engine: HybridEngine) -> tuple[SideCosts, SideCosts]:
    """First (forward, backward) costs for the model's first layer from nominal rates of the machine kind at hand
    (a CUDA GPU on PCIe Gen5; the CPU device standing in for one); measured passes correct them."""
    weights = engine.layers[0].weights
    hidden, inter = weights.hidden_size, weights.intermediate_size
    if engine.device.type == "cuda":
        rates = dict(dram_gbps=100.0, cpu_tflops=3.0, pcie_gbps=50.0, gpu_tflops=400.0)
    else:  # no link: "copies" are host copies, and the same CPU runs both sides
        rates = dict(dram_gbps=20.0, cpu_tflops=0.2, pcie_gbps=20.0, gpu_tflops=0.2)
    rank = max((part.rank for part in engine.layers[0].lora() if part is not None), default=0)
    return (physical_costs(hidden, inter, rank, **rates), physical_costs(hidden, inter, rank, backward=True, **rates))


def new_trackers(engine: HybridEngine) -> dict[str, CostTracker]:
    """Cost trackers (forward, backward) from the first costs, probing the CPU after a step's worth of layer passes
    without it."""
    return {phase: CostTracker(costs, probe_after=len(engine.layers))
            for phase, costs in zip(("forward", "backward"), default_costs(engine))}


class HybridLayer(OffloadLayer):
    """One MoE layer's routed experts, split per pass between the GPU (copied weights) and the CPU (in place)."""

    engine: HybridEngine

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: HybridEngine,
                 index: int) -> None:
        super().__init__(name, experts, wrappers, engine, index)
        self.last_gpu: tuple[int, ...] | None = None  # the GPU experts of the latest forward; backward prefetches
        self.last_cpu = False  # whether the latest forward had a CPU part (its inputs are then staged early)

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        self.check_inputs(hidden, top_k_index, top_k_weights)
        with self.engine.lock:  # the slots are shared: one thread's layer call at a time
            self.engine.join_backward()  # inside a backward (a checkpoint's recomputation): raises the pass's error
            self.engine.join_deferred(self.index)
            return self.checked(self._submit(hidden, top_k_index, top_k_weights))

    def _submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> HybridPending:
        lora = self.lora()
        factors = lora_tensors(lora)
        self.engine.place_lora(factors)
        counts = routed_counts(top_k_index, self.weights.num_experts)  # validated before any state changes
        recompute = self.begin_call(hidden)
        keep = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, top_k_weights, *factors))
        call = _Call(keep, recompute, (self.engine.forward_passes, self.index))
        parts = _Parts()
        out = HybridExpertsFunction.apply(hidden, top_k_weights, top_k_index, self, lora, call, counts, parts,
                                          *factors)
        return HybridPending(out, parts, self.engine, None if recompute else self.index)


@dataclass
class _Parts:
    """What one layer call's forward leaves for ``result()`` and backward."""

    gpu: tuple[int, ...] = ()
    cpu: tuple[int, ...] = ()
    gpu_backward: tuple[int, ...] = ()  # ``gpu`` and the CPU experts whose backward moves to the GPU
    cpu_future: Future | None = None  # -> (host output, SavedState)
    cpu_saved: SavedState | None = None
    gpu_state: SavedState | ParkedState | None = None
    math: ExpertBackend | None = None
    lora: tuple = (None, None)
    cpu_lora: tuple = (None, None)  # the same factors in host memory (mirrors where they live on the GPU)
    weights_host: object = None
    done: bool = False
    published: tuple | None = None  # (number, rows, tokens, weights): the CPU part's rows land in staging views itself


def join_part(parts: _Parts) -> None:
    """Waits for a forward's CPU part that published its rows itself; keeps its saved state (raises its error)."""
    future = parts.cpu_future
    if future is not None and parts.published is not None:
        parts.cpu_saved = future.result()
        parts.cpu_future = None


class HybridPending:
    """``result()`` waits for the CPU part, brings it to the device and adds it to the GPU part."""

    def __init__(self, output: torch.Tensor, parts: _Parts, engine: HybridEngine, index: int | None) -> None:
        self._output, self._parts, self._engine = output, parts, engine
        self._index = index  # the layer, for the gap to the next one (None: a recomputation)

    def result(self) -> torch.Tensor:
        parts, engine = self._parts, self._engine
        if parts.published is not None and not parts.done:
            number, rows, tokens, weights = parts.published
            engine.wait_for_cpu_part(number)
            engine.sides.device_waits += engine.cpu_done.on_device
            with torch.no_grad(), record_function("moecc.hybrid.cpu_to_device"):
                engine.staging.read_views_on_device(
                    {"out": rows, "out_tokens": tokens, "out_weights": weights},
                    lambda out, out_tokens, out_weights: _add_part(self._output, out, out_tokens, out_weights))
            engine.defer(self._index, parts)
        elif parts.cpu_future is not None and not parts.done:
            start = time.perf_counter()
            host, tokens, saved = parts.cpu_future.result()
            engine.sides.cpu_wait_s += time.perf_counter() - start
            parts.cpu_saved = saved
            with torch.no_grad(), record_function("moecc.hybrid.cpu_to_device"):
                # Read in place: the GPU part's output, or zeros, plus the CPU part's (dense, or rows per pair)
                sources = {"out": host} if tokens is None else {"out": host, "out_tokens": tokens}
                engine.staging.read_on_device(sources, lambda out, out_tokens=None: _add_part(self._output, out,
                                                                                              out_tokens))
            engine.cpu.release_result(host)
        if not parts.done and self._index is not None:
            engine.gap_begins("forward", self._index, engine.forward_passes)
        parts.done = True
        return self._output


class HybridExpertsFunction(torch.autograd.Function):
    """Autograd node of one hybrid layer: both parts' forward and backward, their results summed."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, counts, parts, *factors):
        with record_function("moecc.hybrid.layer_forward"):  # the span a timeline zooms in on
            return HybridExpertsFunction._forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call,
                                                  counts, parts)

    @staticmethod
    def _forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, counts, parts):
        engine = layer.engine
        if call.recompute:
            engine.gap_interrupted("backward")
        else:
            engine.gap_ends("forward", layer.index, engine.forward_passes)
        # The CPU part's inputs start for the host before the split where the layer's last forward had one
        staged = _stage_cpu_inputs(engine, layer.index, hidden, top_k_index, top_k_weights, lora) \
            if layer.last_cpu else None
        gpu = engine.forward_split(layer, counts)
        on_gpu = set(gpu)
        cpu = tuple(e for e, n in enumerate(counts) if n > 0 and e not in on_gpu)
        parts.gpu, parts.cpu, parts.lora, parts.weights_host = gpu, cpu, lora, layer.weights
        if cpu:  # first: the CPU starts as soon as the activations reach the host
            staged, parts.cpu_lora, ready = staged or _stage_cpu_inputs(engine, layer.index, hidden, top_k_index,
                                                                        top_k_weights, lora)
            job = (engine, layer, staged, parts.weights_host, parts.cpu_lora, ready, cpu, counts)
            parts.published = _publish_target(engine, layer, call, hidden, top_k_index, counts, cpu)
            if parts.published is None:
                parts.cpu_future = engine.run_cpu(_cpu_forward, *job, mark=("forward", layer.index))
            else:
                try:
                    parts.cpu_future = engine.run_cpu(_cpu_forward_published, parts.published, *job,
                                                      mark=("forward", layer.index))
                except BaseException:
                    engine.cpu_done.publish(parts.published[0])  # never run: no stream may wait for it
                    raise
        # Planned once the CPU part runs: the forward's CPU part does not depend on it
        parts.gpu_backward = engine.backward_split(layer, counts, gpu) if cpu and call.keep else gpu
        if parts.gpu_backward != gpu:
            ctx.top_k_index = top_k_index  # the GPU recomputes the moved experts' forward from it in backward
        slot = engine._timed_fetch("forward", layer, list(gpu)) if gpu else None
        if not call.recompute:
            _record_forward(engine, layer, counts, gpu, cpu, parts.gpu_backward)
            for ahead in range(1, engine.prefetch_depth + 1):
                engine.prefetch_forward(layer.index + ahead)
        if gpu:
            out, parts.gpu_state, parts.math = _gpu_forward(engine, layer, slot, hidden, top_k_index, top_k_weights,
                                                            lora, gpu, call, sum(counts[e] for e in gpu))
        else:
            out = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        ctx.layer, ctx.parts, ctx.call, ctx.counts = layer, parts, call, counts
        ctx.dtypes = (hidden.dtype, top_k_weights.dtype)
        ctx.weights_shape = top_k_weights.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with record_function("moecc.hybrid.layer_backward"):
            return ctx.layer.checked_backward(grad_out, lambda: HybridExpertsFunction._backward(ctx, grad_out))

    @staticmethod
    def _backward(ctx, grad_out):
        layer, parts, engine = ctx.layer, ctx.parts, ctx.layer.engine
        # The layer after's CPU part: its error stops the pass before this layer changes (a reentrant checkpoint
        # segment's own pass files an outer part's error for the outer pass, which raises it at its next join)
        engine.join_backward()
        if engine.first_backward_pass is None:
            engine.first_backward_pass = engine.forward_passes
        join_part(parts)
        if not parts.done or (parts.cpu and parts.cpu_saved is None) or (parts.gpu and parts.gpu_state is None):
            raise saved_state_gone("hybrid")
        engine.gap_ends("backward", layer.index, _differentiated_pass(ctx.call))
        cpu_future = published = None
        moved = tuple(e for e in parts.gpu_backward if e not in set(parts.gpu))
        cpu_experts = tuple(e for e in parts.cpu if e not in set(moved))
        saved, parts.cpu_saved = parts.cpu_saved, None
        if saved is not None and not cpu_experts:  # every CPU expert's backward moved to the GPU
            getattr(engine.cpu, "release", lambda state: None)(saved)
        elif cpu_experts:
            counts = [ctx.counts[e] for e in cpu_experts]
            staged = engine.staging.to_host({"grad_out": grad_out.contiguous()})
            published = _backward_publish_target(engine, layer, parts, grad_out, ctx.weights_shape, counts,
                                                 cpu_experts)
            job = (engine, layer.index, parts, saved, staged, counts, cpu_experts if moved else None)
            if published is None:
                cpu_future = engine.run_cpu(_cpu_backward, *job, mark=("backward", layer.index))
            else:
                try:
                    cpu_future = engine.run_cpu(_cpu_backward_published, published, *job,
                                                mark=("backward", layer.index))
                except BaseException:
                    engine.cpu_done.publish(published[0])  # never run: no stream may wait for it
                    raise
                engine.defer_backward(cpu_future)  # now: joined even where this call fails before its sums
        slot = (engine._timed_fetch("backward", layer, list(parts.gpu_backward), parts.lora)
                if parts.gpu_backward else None)
        if isinstance(parts.gpu_state, ParkedState):
            engine.parking.restore(parts.gpu_state)  # queued now unless the layer after prefetched it
        _prefetch_backward(engine, layer, ctx.call)  # queued before this layer's compute
        grads = (_gpu_backward(engine, layer, parts, slot, grad_out, moved, ctx) if parts.gpu else None)
        if published is not None:
            number, bank, views = published
            engine.wait_for_cpu_part(number)
            engine.sides.backward_device_waits += engine.cpu_done.on_device
            with torch.no_grad():
                grads = _add(engine.staging, grads, views, bank, parts.lora, grad_out, ctx.weights_shape)
        elif cpu_future is not None:
            start = time.perf_counter()
            cpu_hidden, cpu_tokens, cpu_weights, cpu_lora = cpu_future.result()
            engine.sides.cpu_wait_s += time.perf_counter() - start
            sources = _cpu_sources(cpu_hidden, cpu_tokens, cpu_weights, cpu_lora, cpu_experts, parts.lora)
            grads = _add(engine.staging, grads, sources, "", parts.lora, grad_out, ctx.weights_shape)
            # Read: _add took copies of what it sums (index_select of the LoRA gradients' CPU expert blocks)
            for result in (cpu_hidden, *vars(cpu_lora).values()):
                if result is not None:
                    engine.cpu.release_result(result)
        if grads is None:  # no routed pair on either side (no tokens): every gradient is zero
            grads = _zero_grads(grad_out, ctx.weights_shape, parts.lora)
        grad_hidden, grad_weights, lora_grads = grads
        engine.gap_begins("backward", layer.index, _differentiated_pass(ctx.call))
        return node_gradients(grad_hidden.to(ctx.dtypes[0]), grad_weights.to(ctx.dtypes[1]), 6, parts.lora,
                              lora_grads)


def _stage_cpu_inputs(engine: HybridEngine, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, lora: tuple) -> tuple:
    """(the activations and routing on their way to the host, the LoRA factors as the CPU reads them, the event
    those are ready at)."""
    staged = engine.staging.to_host({"hidden": hidden.detach().contiguous(), "top_k_index": top_k_index.contiguous(),
                                     "top_k_weights": top_k_weights.detach().contiguous()})
    return (staged, *engine.host_lora(index, lora))


def _record_forward(engine: HybridEngine, layer: HybridLayer, counts: list[int], gpu: tuple, cpu: tuple,
                    gpu_backward: tuple) -> None:
    """Metrics and the forecast, once per real (not recomputed) forward of a layer."""
    s = engine.sides
    s.layer_passes += 1
    s.both_sides += bool(gpu and cpu)
    s.cpu_experts += len(cpu)
    s.cpu_pairs += sum(counts[e] for e in cpu)
    s.gpu_experts += sum(1 for e in gpu if counts[e] > 0)
    s.gpu_pairs += sum(counts[e] for e in gpu)
    planned = engine.planned.get(layer.index)
    if planned is not None:
        s.prefetch_hits += hit_rate(planned, counts)
        s.prefetched_forwards += 1
    engine.metrics.add_expert_counts(counts)
    engine.metrics.tokens_routed += sum(counts)
    engine.forecast.observe(layer.index, counts)
    if engine.cache is not None:  # its refill keeps the most routed experts (offload feeds it the same way)
        engine.cache.observe(layer.index, counts)
    if engine.trackers is not None and any(counts) and engine.step_mode == SPLIT:  # the guard's steps: no verdict
        with engine.measure_lock:
            engine.trackers["forward"].ran(bool(cpu))
            engine.trackers["backward"].ran(bool(set(cpu) - set(gpu_backward)))
    s.moved_experts += len(gpu_backward) - len(gpu)
    layer.last_gpu, layer.last_cpu = gpu_backward, bool(cpu)


def _grouping(engine: HybridEngine, top_k_index: torch.Tensor, num_experts: int, experts: tuple[int, ...],
              pairs: int):
    """The grouping of ``experts``' routed pairs (``pairs`` of them, counted on the host): every pair's, with no
    mask or subset (their ~15 ops), where those experts hold every routed pair."""
    if pairs == top_k_index.numel():
        return group_by_expert(top_k_index, num_experts)
    return group_by_expert(top_k_index, num_experts, _mask(experts, num_experts, engine.staging), num_pairs=pairs)


def _gpu_forward(engine: HybridEngine, layer: HybridLayer, slot, hidden, top_k_index, top_k_weights, lora, gpu,
                 call, pairs: int):
    # The subset's size from the host's counts: sized by a sync, it kept the host waiting for this layer's copies
    grouping = _grouping(engine, top_k_index, layer.weights.num_experts, gpu, pairs)
    engine.use(slot)
    begun = engine.compute_begins()
    device_lora = engine.device_lora(slot, lora)
    math = device_backend(engine.compute)
    with record_function("moecc.hybrid.gpu_forward"):
        out, saved = math.forward(layer.device_weights(slot), hidden, top_k_index, top_k_weights, *device_lora,
                                  grouping=grouping)
    engine.done_with(slot)
    engine.compute_ends(begun, backward=False)
    return out, engine.keep_for_backward(call, saved), math


def _gpu_backward(engine: HybridEngine, layer: HybridLayer, parts: _Parts, slot, grad_out, moved: tuple, ctx):
    """The GPU part's gradients: its own forward's experts from their saved state; with ``moved`` experts (whose
    forward ran on the CPU) as well, every one of ``parts.gpu_backward`` from one forward recomputed on the hidden
    states that state holds, and one backward: two parts' calls and their sum queued twice the host's ops, on a
    host thread that paces the backward at small batches."""
    state, parts.gpu_state = parts.gpu_state, None
    engine.use(slot)
    saved = engine.unpark(state)
    begun = engine.compute_begins()
    device_lora = engine.device_lora(slot, parts.lora)
    weights = layer.device_weights(slot)
    with record_function("moecc.hybrid.gpu_backward"):
        if moved:
            experts = parts.gpu_backward
            grouping = _grouping(engine, ctx.top_k_index, layer.weights.num_experts, experts,
                                 sum(ctx.counts[e] for e in experts))
            with torch.no_grad():
                _, saved = parts.math.forward(weights, saved.hidden, ctx.top_k_index, saved.top_k_weights,
                                              *device_lora, grouping=grouping)
        result = parts.math.backward(weights, saved, grad_out, *device_lora)
    engine.done_with(slot)
    engine.compute_ends(begun, backward=True)
    return result


def _prefetch_backward(engine: HybridEngine, layer: HybridLayer, call) -> None:
    """Queues the GPU experts (known exactly from their forward) and parked activations of the layers before, as
    many as the slots hold beside this one's."""
    for previous in engine.layers[max(0, layer.index - engine.prefetch_depth):layer.index][::-1]:
        if previous.last_gpu:
            engine._timed_fetch("backward", previous, list(previous.last_gpu))
        engine.parking.prefetch((call.key[0], previous.index))


def _zero_grads(grad_out: torch.Tensor, weights_shape: torch.Size, lora: tuple) -> tuple:
    """(grad_hidden, grad_top_k_weights, LoraGrads) of a layer call that routed nothing: zeros."""
    return torch.zeros_like(grad_out), grad_out.new_zeros(weights_shape), LoraGrads.zeros(*lora)


HybridEngine.layer_class = HybridLayer
