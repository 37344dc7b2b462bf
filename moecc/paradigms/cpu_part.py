"""Hybrid's CPU part: the cold experts of a layer pass computed in place on the CPU while the GPU computes the rest.

``CpuPart`` owns what that side needs — the CPU backend (a ``PairRowsBackend``: rows per pair, written where the
device reads them), the staging buffers, the worker thread, the pinned mirrors of device-resident LoRA factors and
the counter the device waits on (``CpuDone``). Each part it runs lands one way, a ``Landing``: either the part
writes its results into staging views taken beforehand and publishes a number the device waits for itself
(``number`` set, the caller going on), or the caller waits for the worker and reads the results in place from
host memory. Either way the consumer gets the results by role (``Landing.collect``) and sums them with the GPU
part's (``moecc.paradigms.part_sums``).

A part that lands on the device is joined later: a forward's by the same thread's next layer call
(``join_deferred``), a backward's by the next backward layer call, a forward, or the end of its backward pass
(``join_backward``), whose ``backward()`` then raises its error, before anything changes, so a failed part leaves
the model as usable as before.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.profiler import record_function

from .. import _ops
from ..experts import ExpertBackend, ExpertLora, ExpertWeights, SavedState
from ..experts.native import rows_pay
from ..experts.types import PairRowsBackend
from ..lora import lora_tensors
from ..staging import StagingBuffers
from .base import Worker, current_graph_task
from .device_wait import CpuDone
from .event_spans import EventSpans, timed_event
from .part_sums import expert_mask, grouped_shape, pair_grads
from .torch_internals import queue_callback

_KEPT_ERRORS = 16  # backward parts' errors kept for passes that have not claimed them


class DenseAsPairs:
    """A backend without rows per pair (the reference) as a ``PairRowsBackend`` that never returns rows: its
    dense results, summed on the device as they are."""

    fresh_bytes = 0

    def __init__(self, backend: ExpertBackend) -> None:
        self.backend = backend

    def returns_rows(self, weights: ExpertWeights) -> bool:
        return False

    def forward_pairs(self, weights: ExpertWeights, *args, **kwargs) -> tuple:
        out, saved = self.backend.forward(weights, *args, **kwargs)
        return out, None, saved

    def backward_pairs(self, weights: ExpertWeights, *args) -> tuple:
        grad_hidden, grad_weights, grads = self.backend.backward(weights, *args)
        return grad_hidden, None, grad_weights, grads

    def forward_pairs_into(self, *args, **kwargs) -> SavedState:
        raise NotImplementedError("returns_rows is False: nothing lands in the caller's buffers")

    backward_pairs_into = forward_pairs_into

    def keep_experts(self, weights: ExpertWeights, saved: SavedState, experts) -> SavedState:
        return self.backend.keep_experts(weights, saved, experts)

    def release(self, saved: SavedState) -> None:
        pass

    def release_result(self, tensor: torch.Tensor) -> None:
        self.backend.release_result(tensor)

    def prepare_layers(self, weights: list[ExpertWeights]) -> None:
        self.backend.prepare_layers(weights)


@dataclass
class CpuMetrics:
    """The CPU side's counters since the last reset (seconds, and parts)."""

    cpu_s: float = 0.0
    wait_s: float = 0.0  # the caller blocked on CPU parts (a forward's result, a backward's join)
    device_waits: int = 0  # forwards whose part the device waited for itself, the host going on
    backward_device_waits: int = 0  # the same for backwards
    cold_parts: int = 0  # parts during which the backend's buffer pools grew (not fitted)
    device_wait_events: EventSpans = field(default_factory=EventSpans)  # around the device's waits


@dataclass
class Landing:
    """Where one CPU part's results land: ``views`` it writes and then publishes ``number`` for the device to wait
    on (``bank``: their roles' prefix), or, with ``number`` None, host results the caller waits for."""

    future: Future
    number: int | None = None
    views: dict[str, torch.Tensor] | None = None
    bank: str = ""

    @property
    def on_device(self) -> bool:
        return self.number is not None


class CpuPart:
    """The CPU side of one hybrid engine; ``measured(phase, counts, seconds)`` gets each fitted part's time;
    ``lock``: the engine's, held around joins at a backward pass's end."""

    def __init__(self, device: torch.device, backend: ExpertBackend, measured: Callable[[str, list, float], None],
                 lock: threading.RLock) -> None:
        self.device, self.lock = device, lock
        self.given = backend  # as configured, for the summary line
        self.backend: PairRowsBackend = backend if isinstance(backend, PairRowsBackend) else DenseAsPairs(backend)
        self.staging = StagingBuffers(device)  # numbered ("cuda" as "cuda:0")
        self.worker = Worker("moecc-hybrid-cpu")
        self.done = CpuDone(device)
        self.metrics = CpuMetrics()
        self.measure_lock = threading.Lock()  # the worker's timings against the caller's reads and resets
        self._measured = measured
        self._seen: set[tuple[str, int]] = set()  # (pass, layer) with a part measured
        # Timelines set a list: (pass, layer, "submitted" | "started" | "computed" | "done", Unix ns) of each part
        self.marks: list | None = None
        # Device-resident LoRA factors: the part reads host mirrors, copied once per pass on their own stream.
        self.mirror_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._mirrors: dict[int, tuple[list, list[torch.Tensor]]] = {}  # layer -> (factors, pinned host copies)
        self._deferred = threading.local()  # .parts: this thread's forwards' landings not joined yet
        # Backwards' parts the device waits for itself, not joined yet (any thread's): (graph task, future); the
        # errors of joined ones, kept for their pass (graph task) to raise
        self._backward_parts: list[tuple[int, Future]] = []
        self._backward_errors: dict[int, BaseException] = {}
        self._backward_lock = threading.Lock()
        self.first_backward_pass: int | None = None  # the engine's forward passes when a backward first ran

    def reset_metrics(self) -> None:
        with self.measure_lock:
            self.metrics = CpuMetrics()

    def host_lora(self, index: int, lora: tuple) -> tuple[tuple, torch.cuda.Event | None]:
        """The factors as the part reads them: ``lora`` itself in host memory, else layer ``index``'s pinned
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

    def stage(self, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              lora: tuple) -> tuple:
        """(the activations and routing on their way to the host, the LoRA factors as the part reads them, the
        event those are ready at)."""
        staged = self.staging.to_host({"hidden": hidden.detach().contiguous(),
                                       "top_k_index": top_k_index.contiguous(),
                                       "top_k_weights": top_k_weights.detach().contiguous()})
        return (staged, *self.host_lora(index, lora))

    # Running parts ---------------------------------------------------------------------------------------------

    def may_land_on_device(self, weights: ExpertWeights, factors, forward_passes: int, backward: bool) -> bool:
        """Whether a part may publish its results for the device to wait on. Not in the first forward pass, nor in
        a backward before one backward pass has run in an earlier step: by then every kernel a step launches,
        JIT-compiled ones too, has been loaded once, and none loads behind a pending wait. The backend must return
        rows for the layer, the device must be CUDA with a working stream wait (or the CPU, where the wait blocks
        the host), and the LoRA factors on the engine's device (host factors are summed on the host)."""
        device_wait = self.done.on_device and self.staging.mapped
        loaded = (self.first_backward_pass is not None and self.first_backward_pass < forward_passes
                  if backward else forward_passes >= 2)
        return (loaded and self.backend.returns_rows(weights) and (device_wait or self.device.type == "cpu")
                and all(t is None or t.device == self.device for t in factors))

    def forward(self, index: int, weights: ExpertWeights, staged, lora: tuple, lora_ready, cpu: tuple[int, ...],
                counts: list[int], rows: tuple[int, int] | None) -> Landing:
        """Submits the forward of the ``cpu`` experts; ``rows`` ``(pairs, hidden size)`` where the part lands on
        the device (rows bf16 before their routing weights, their tokens and weights in staging views)."""
        job = (index, weights, staged, lora, lora_ready, cpu, counts)
        if rows is None:
            return Landing(self._run(self._forward, *job, mark=("forward", index)))
        views = {"out": self.staging.view("out", rows, torch.bfloat16),
                 "out_tokens": self.staging.view("out_tokens", rows[:1], torch.int64),
                 "out_weights": self.staging.view("out_weights", rows[:1], torch.float32)}
        return self._publishing(Landing(None, self.done.issue(), views), self._forward, job, "forward", index)

    def backward(self, index: int, weights: ExpertWeights, saved: SavedState, staged, lora: tuple,
                 counts: list[int], kept: tuple[int, ...] | None, target: tuple | None) -> Landing:
        """Submits the backward of a forward's part (``kept``: of those experts alone, the others' moved to the
        GPU); ``target`` from :meth:`backward_target` where it lands on the device."""
        job = (index, weights, saved, staged, lora, counts, kept)
        if target is None:
            return Landing(self._run(self._backward, *job, mark=("backward", index)))
        bank, views = target
        landing = self._publishing(Landing(None, self.done.issue(), views, bank), self._backward, job, "backward",
                                   index)
        self.defer_backward(landing.future)  # now: joined even where the caller fails before its sums
        return landing

    def backward_target(self, index: int, num_experts: int, lora: tuple, grad_out: torch.Tensor,
                        weights_shape: torch.Size, cpu_experts: tuple[int, ...], pairs: int) -> tuple:
        """(bank, staging views by role) a backward part lands its results in: the input gradient's rows and
        their tokens, the routing-weight gradient, the ids of the ``cpu_experts`` and, per LoRA factor, those
        experts' blocks of its gradient (``grouped_shape``). Layers alternate between two banks of roles, so the
        next layer's views are not ones the device may still read."""
        bank = f"backward{index % 2}_"
        shapes = {"grad_hidden": ((pairs, grad_out.shape[1]), torch.bfloat16), "grad_tokens": ((pairs,), torch.int64),
                  "grad_weights": (tuple(weights_shape), torch.float32),
                  "lora_index": ((len(cpu_experts),), torch.int64)}
        for which, factor in enumerate(lora_tensors(lora)):
            if factor is not None:
                shapes[f"lora_blocks{which}"] = (grouped_shape(factor.shape, num_experts, which, len(cpu_experts)),
                                                 torch.float32)
        views = {bank + role: self.staging.view(bank + role, shape, dtype) for role, (shape, dtype) in shapes.items()}
        views[bank + "lora_index"].copy_(torch.tensor(cpu_experts, dtype=torch.int64))
        return bank, views

    def _publishing(self, landing: Landing, job_fn, job: tuple, phase: str, index: int) -> Landing:
        """Runs ``job_fn(*job, into=views)`` and then publishes the landing's number, also when it fails (no stream
        may wait for ever; the error reaches the join), its views zeroed so what the device reads stays in bounds."""
        def run():
            try:
                return job_fn(*job, into=landing.views)
            except BaseException:
                for view in landing.views.values():
                    view.zero_()
                raise
            finally:
                self.done.publish(landing.number)
        try:
            landing.future = self._run(run, mark=(phase, index))
        except BaseException:
            self.done.publish(landing.number)  # never run: no stream may wait for it
            raise
        return landing

    def _run(self, fn, *args, mark: tuple[str, int]) -> Future:
        """``fn(*args)`` on the worker; ``mark`` (pass, layer) names it in ``marks``."""
        marks = self.marks
        if marks is None:
            return self.worker.submit(fn, *args)
        marks.append((*mark, "submitted", time.time_ns()))

        def marked():
            try:
                return fn(*args)
            finally:
                marks.append((*mark, "done", time.time_ns()))
        return self.worker.submit(marked)

    def _forward(self, index: int, weights: ExpertWeights, staged, lora: tuple, lora_ready, cpu: tuple[int, ...],
                 counts: list[int], into: dict | None = None):
        """(out or rows, their tokens or None, saved) of the CPU experts; with ``into`` the saved state alone."""
        views = staged.wait()
        if lora_ready is not None:
            lora_ready.synchronize()
        began_ns, start, fresh = time.time_ns(), time.perf_counter(), self.backend.fresh_bytes
        args = (weights, views["hidden"], views["top_k_index"], views["top_k_weights"], *lora)
        mask = expert_mask(cpu, weights.num_experts)
        with record_function("moecc.hybrid.cpu_forward"):
            if into is not None:
                result = self.backend.forward_pairs_into(*args, expert_mask=mask, rows=into["out"],
                                                         tokens=into["out_tokens"], weights_out=into["out_weights"])
            else:  # rows per pair (summed on the device), or dense
                result = self.backend.forward_pairs(*args, expert_mask=mask)
        self.record("forward", index, [counts[e] for e in cpu], time.perf_counter() - start, began_ns,
                     cold=self.backend.fresh_bytes != fresh)
        return result

    def _backward(self, index: int, weights: ExpertWeights, saved: SavedState, staged, lora: tuple,
                  counts: list[int], kept: tuple[int, ...] | None, into: dict | None = None):
        """(grad_hidden or rows, tokens or None, grad_top_k_weights, LoraGrads); with ``into`` (views of
        :meth:`backward_target`) written there, and None."""
        if kept is not None:
            saved = self.backend.keep_experts(weights, saved, kept)
        views = staged.wait()
        began_ns, start, fresh = time.time_ns(), time.perf_counter(), self.backend.fresh_bytes
        args = (weights, saved, views["grad_out"], *lora)
        with record_function("moecc.hybrid.cpu_backward"):
            if into is not None:
                result = self.backend.backward_pairs_into(*args, out=pair_grads(into, _bank_of(into)))
            else:
                result = self.backend.backward_pairs(*args)
        self.record("backward", index, counts, time.perf_counter() - start, began_ns,
                     cold=self.backend.fresh_bytes != fresh)
        return result

    def record(self, phase: str, index: int, counts: list[int], seconds: float, began_ns: int, cold: bool) -> None:
        """One part's seconds, from the worker: the metrics, a timeline's span and the policy's sample. A layer's
        first part of each pass kind is not fitted, nor a ``cold`` one (the backend's buffer pools grew during
        it): both paid page faults of first touch that the next parts do not, and a fit that learnt them kept the
        CPU out of the splits of a whole step or more (a new batch size grows the pools again)."""
        with self.measure_lock:
            if self.marks is not None:
                self.marks += [(phase, index, "started", began_ns),
                               (phase, index, "computed", began_ns + int(seconds * 1e9))]
            self.metrics.cpu_s += seconds
            self.metrics.cold_parts += cold
            first = (phase, index) not in self._seen
            self._seen.add((phase, index))
        if not first and not cold:
            self._measured(phase, counts, seconds)

    # Landing ---------------------------------------------------------------------------------------------------

    def collect(self, landing: Landing) -> dict[str, torch.Tensor]:
        """The views by role of a landing on the device, the device's stream waiting for them where it can (this
        thread goes on: ``device_wait_events``), else this thread (``wait_s``)."""
        stream = torch.cuda.current_stream(self.device) if self.done.on_device else None
        before = timed_event(stream) if stream is not None else None
        start = time.perf_counter()
        self.done.wait(landing.number)
        if before is not None and self.done.on_device:
            self.metrics.device_wait_events.add(before, timed_event(stream))
        else:
            self.metrics.wait_s += time.perf_counter() - start
        return landing.views

    def host_result(self, landing: Landing):
        """The worker's result of a landing in host memory, this thread waiting for it (``wait_s``)."""
        start = time.perf_counter()
        result = landing.future.result()
        self.metrics.wait_s += time.perf_counter() - start
        return result

    def defer(self, layer_index: int, parts) -> None:
        """``parts`` (of layer ``layer_index``) landed on the device: joined by this thread's next layer call."""
        pending = self._deferred.__dict__.setdefault("parts", [])
        pending.append((layer_index, parts))

    def join_deferred(self, layer_index: int, join: Callable) -> None:
        """Waits for the parts the device waited for on its own (this thread's earlier layer calls; ``join(parts)``
        each) and raises the first error of those before layer ``layer_index``: the pass whose outputs used them
        must not go on. Parts of layers at or after ``layer_index`` are of a pass that ended without reaching the
        next layer (an error between the layers): joined, their errors dropped with that pass."""
        pending = self._deferred.__dict__.get("parts")
        if not pending:
            return
        self._deferred.parts = []
        start, error = time.perf_counter(), None
        for index, parts in pending:
            try:
                join(parts)
            except BaseException as caught:  # every part is joined before the first error is raised
                if index < layer_index:
                    error = error or caught
        self.metrics.wait_s += time.perf_counter() - start
        if error is not None:
            raise error

    def defer_backward(self, future: Future) -> None:
        """A backward's part that the device will wait for itself, registered as soon as it is submitted: joined
        by the next backward layer call, a forward, or the end of the backward pass running now."""
        with self._backward_lock:
            self._backward_parts.append((current_graph_task(), future))
        queue_callback(self.join_backward)

    def join_backward(self) -> None:
        """Waits for every backward part not joined yet; raises the first error of the calling thread's backward
        pass among them. The others' errors are kept for their own passes: a forward, or another thread's
        backward, never takes them. A pass that died raised already and never claims its parts' errors; those
        kept are bounded. Under the engine's lock throughout: a pass's end must not find its parts taken by another
        thread's join that has not filed their errors yet."""
        with self.lock:
            self._join_backward(current_graph_task())

    def _join_backward(self, task: int) -> None:
        with self._backward_lock:
            pending, self._backward_parts = self._backward_parts, []
        start = time.perf_counter()
        for owner, future in pending:
            try:
                future.result()
            except BaseException as caught:  # every part is joined before an error is raised
                with self._backward_lock:
                    self._backward_errors.setdefault(owner, caught)
                    while len(self._backward_errors) > _KEPT_ERRORS:
                        self._backward_errors.pop(next(iter(self._backward_errors)))
        if pending:
            with self.measure_lock:
                self.metrics.wait_s += time.perf_counter() - start
        if task != -1:
            with self._backward_lock:
                error = self._backward_errors.pop(task, None)
            if error is not None:
                raise error


def forward_rows(may_land: bool, last_layer: bool, pairs: int, routed: int, hidden: torch.Tensor
                 ) -> tuple[int, int] | None:
    """``(pairs, hidden size)`` of a forward part that lands on the device (``CpuPart.forward``'s ``rows``), or
    None where the caller waits: also the last layer (nothing after it would join the part), a part holding
    every pair, and one whose results leave dense (``rows_pay``)."""
    if not may_land or last_layer or pairs >= routed or not rows_pay(pairs, hidden.shape[0]):
        return None
    return pairs, hidden.shape[1]


def _bank_of(views: dict[str, torch.Tensor]) -> str:
    """The role prefix of ``CpuPart.backward_target``'s views."""
    name = next(iter(views))
    return name[:name.index("_") + 1]


def hybrid_pool_threads() -> int:
    """The native pool's threads on a GPU machine running hybrid: all CPUs but two, which are left to the threads
    that queue the GPU work and drive the copies (with every core in the pool the CPU kernels ran 2.2x slower while
    PCIe streamed)."""
    return max(1, _ops.available_cpus() - 2)


def configure_cpu_threads(pin_threads: bool = True) -> int:
    """Sets the native pool to :func:`hybrid_pool_threads` (benchmarks of the CPU part alone); returns them."""
    pool = hybrid_pool_threads()
    _ops.configure_pool(pool, pin_threads)
    return pool
