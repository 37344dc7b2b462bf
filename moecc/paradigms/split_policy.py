"""Which of a layer's routed experts hybrid runs on the GPU: the ``SplitPolicy`` contract and its two built-ins.

A policy plans three things for the engine — a layer's forward split once its routing is known, the experts to
copy ahead for a layer whose routing is not known yet (the prefetch), and a backward's split after a forward ran
``gpu`` on the GPU — and is told what each pass measured: CPU parts, copies, the gaps between layers. The engine
does everything else (copies, CPU parts, sums), so a policy is pure choice and never changes a result's bits
beyond where each expert's math runs.

``PlannedSplit`` (the default, ``"planned"``) balances CPU seconds against copy and GPU seconds with
``plan_split`` over costs that ``CostTracker`` corrects from what passes measure while both sides run, forecasts
routing for the prefetch (``RoutingForecast``) and, on a CUDA GPU, lets ``StepGuard`` run whole steps with every
expert on the GPU where those are faster. ``FixedSplit`` takes a rule (tests, A/B runs). Other policies register
in ``moecc.paradigms.split_policies``.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Protocol, runtime_checkable

import torch

from .hybrid_split import CostTracker, RoutingForecast, SideCosts, physical_costs, plan_split
from .step_guard import GPU, StepGuard, size_bucket

_PASSES_KEPT = 1024  # forward passes whose sizes are kept for their backwards' gaps (micro-batches before them)
# A rule: (layer index, tokens per expert, "forward" | "backward") -> the experts to run on the GPU.
SplitRule = Callable[[int, list, str], Iterable[int]]


@runtime_checkable
class SplitPolicy(Protocol):
    """What hybrid asks of a split policy. Sets are expert ids of one layer; ``counts[e]``: routed pairs of e.
    A policy that subclasses this protocol gets the defaults below: no prefetch, no observations, no counters."""

    name: str

    def start(self, device: torch.device, layers: list) -> None:
        """Once, when the engine is finished: its device and its layers (model order)."""

    def pass_begins(self, tokens: int, training: bool) -> bool:
        """A forward pass of ``tokens`` begins; returns whether every routed expert runs on the GPU in it."""
        return False

    def forward(self, layer, counts: list[int], resident: set[int], committed: set[int]) -> tuple[int, ...]:
        """The GPU experts of ``layer``'s forward (sorted). ``resident``: on the GPU already, no copy;
        ``committed``: copied for this pass already (a prefetch), their copies spent whatever runs where."""
        raise NotImplementedError

    def prefetch(self, index: int, resident: set[int]) -> tuple[int, ...] | None:
        """The experts to copy ahead for layer ``index``, whose routing is not known yet (None: none)."""
        return None

    def backward(self, layer, counts: list[int], gpu: tuple[int, ...], resident: set[int]) -> tuple[int, ...]:
        """The GPU experts of the backward of a forward that ran ``gpu`` there: ``gpu`` and any CPU experts whose
        backward moves (the GPU recomputes their forward), sorted."""
        return gpu

    def layer_ran(self, index: int, counts: list[int], cpu: bool, cpu_backward: bool) -> None:
        """A real (not recomputed) forward of layer ``index`` routed ``counts``; whether its forward and its
        backward have a CPU part."""

    def cpu_measured(self, phase: str, counts: list[int], seconds: float) -> None:
        """A CPU part's measured seconds (``phase``: forward / backward; ``counts``: its experts' pairs), from the
        worker thread; first and cold parts are not reported."""

    def copies_measured(self, phase: str, experts: int, timing) -> None:
        """Whole experts copied for a ``phase`` pass and their timing (seconds, or a pair of CUDA events)."""

    def gap(self, phase: str, index: int, forward_pass: int | None, ends: bool) -> None:
        """Layer ``index``'s experts are done (``ends`` False) or their inputs ready (True) in a ``phase`` pass of
        forward pass ``forward_pass`` (None: not known, a recomputation: the gap open is dropped)."""

    def counters(self) -> dict[str, float]:
        """The policy's own metrics (``cpu_slowdown``, ``copy_slowdown``: measured over predicted seconds)."""
        return {"cpu_slowdown": 1.0, "copy_slowdown": 1.0}


class FixedSplit(SplitPolicy):
    """A rule's splits, no prefetch and no step guard: for tests and A/B runs of chosen placements."""

    name = "fixed"

    def __init__(self, rule: SplitRule) -> None:
        self.rule = rule

    def forward(self, layer, counts: list[int], resident: set[int], committed: set[int]) -> tuple[int, ...]:
        return tuple(sorted({int(e) for e in self.rule(layer.index, counts, "forward")}))

    def backward(self, layer, counts: list[int], gpu: tuple[int, ...], resident: set[int]) -> tuple[int, ...]:
        return tuple(sorted({int(e) for e in self.rule(layer.index, counts, "backward")} | set(gpu)))


class PlannedSplit(SplitPolicy):
    """``plan_split`` over measured costs, a routing forecast for the prefetch and (on CUDA) the step guard.

    ``guard``: the step guard to use (default: one on a CUDA GPU, none on the CPU device, whose stand-in "link" has
    no time a split saves); pass ``None`` for the splits always."""

    name = "planned"

    def __init__(self, guard: StepGuard | None | str = "default") -> None:
        self._guard_setting = guard
        self.guard: StepGuard | None = None
        self.forecast = RoutingForecast()
        self.trackers: dict[str, CostTracker] | None = None  # per pass kind; made in start, from the first layer
        self.lock = threading.Lock()  # the worker's CPU samples against the caller's plans
        self.all_on_gpu = False  # this pass's: the guard runs every routed expert on the GPU
        self._size = 0  # this pass's batch-size bucket
        self._device: torch.device | None = None  # CUDA: marks are events on its stream
        self._copy_samples: list[tuple[str, int, object]] = []  # (pass, experts copied, (begin, end) | seconds)
        # The GPU's work between one layer's experts and the next's (SideCosts.serial_s): phase -> (layer, forward
        # pass, mark) of the gap open now, and (phase, forward pass, begin, end) of the gaps measured, read at the
        # next pass; a backward's gaps are its forward pass's (another pass may begin in between: a reference
        # model's forward, a second micro-batch)
        self._gap_open: dict[str, tuple[int, int, object]] = {}
        self._gap_samples: list[tuple[str, int, object, object]] = []
        # Forward pass -> (batch-size bucket, whether every expert ran on the GPU: its gaps are not a split's), for
        # the last passes; (phase, bucket) whose first pass with gaps came (buffers grow, kernels load: not taken)
        self._passes: dict[int, tuple[int, bool]] = {}
        self._gaps_seen: set[tuple[str, int]] = set()
        self._forward_passes = 0

    def start(self, device: torch.device, layers: list) -> None:
        self._device = device if device.type == "cuda" else None
        if self._guard_setting == "default":
            self.guard = StepGuard(seconds_between, done=mark_done) if self._device is not None else None
        else:
            self.guard = self._guard_setting
        if self.trackers is None and layers:
            self.trackers = {phase: CostTracker(costs, probe_after=len(layers))
                             for phase, costs in zip(("forward", "backward"), default_costs(device, layers[0]))}

    def costs(self, phase: str) -> SideCosts:
        """The costs ``phase``'s splits are planned with."""
        with self.lock:
            return self.trackers[phase].costs(self._size)

    def pass_begins(self, tokens: int, training: bool) -> bool:
        self._forward_passes += 1
        self._learn()
        self.all_on_gpu = False
        if self.guard is not None:
            self.all_on_gpu = self.guard.step_begins(tokens, self._mark(), training) == GPU
        self._size = size_bucket(tokens)
        # A pass with every expert on the GPU measures the GPU's share of the gap alone, not a split's
        self._passes[self._forward_passes] = (self._size, self.all_on_gpu)
        self._passes.pop(self._forward_passes - _PASSES_KEPT, None)  # passes are numbered one by one
        return self.all_on_gpu

    def forward(self, layer, counts: list[int], resident: set[int], committed: set[int]) -> tuple[int, ...]:
        """The plan for these very counts with the experts already in the slot (prefetched from the forecast) on
        the GPU and their copies charged to this layer, so a routed expert the forecast missed is copied now only
        where that beats running it on the CPU beside them (cached experts cost no copy)."""
        if self.all_on_gpu:
            return tuple(e for e, n in enumerate(counts) if n > 0)
        return plan_split(counts, self.costs("forward"), resident=resident, committed=committed,
                          then=self.costs("backward")).gpu

    def prefetch(self, index: int, resident: set[int]) -> tuple[int, ...] | None:
        expected = self.forecast.expected(index)
        if expected is None:
            return None
        # Below half a token the forecast is an expert the recent passes stopped routing to, not a CPU part's cost.
        expected = [n if n >= 0.5 else 0.0 for n in expected]
        if self.all_on_gpu:
            return tuple(e for e, n in enumerate(expected) if n > 0)
        return plan_split(expected, self.costs("forward"), resident=resident, then=self.costs("backward")).gpu

    def backward(self, layer, counts: list[int], gpu: tuple[int, ...], resident: set[int]) -> tuple[int, ...]:
        """``gpu``, plus CPU experts whose backward pays on the GPU (the CPU's backward costs about twice its
        forward, the copies the same)."""
        chosen = set(plan_split(counts, self.costs("backward"), resident=resident, required=gpu,
                                recompute=self.costs("forward")).gpu)
        return tuple(sorted(chosen | set(gpu)))

    def layer_ran(self, index: int, counts: list[int], cpu: bool, cpu_backward: bool) -> None:
        self.forecast.observe(index, counts)
        if self.trackers is not None and any(counts) and not self.all_on_gpu:  # the guard's steps: no verdict
            with self.lock:
                self.trackers["forward"].ran(cpu)
                self.trackers["backward"].ran(cpu_backward)

    def cpu_measured(self, phase: str, counts: list[int], seconds: float) -> None:
        if self.trackers is not None:
            with self.lock:
                self.trackers[phase].observe(counts, seconds, 0, 0.0)

    def copies_measured(self, phase: str, experts: int, timing) -> None:
        self._copy_samples.append((phase, experts, timing))

    def gap(self, phase: str, index: int, forward_pass: int | None, ends: bool) -> None:
        """Gaps are samples between consecutive layers of one pass: forward i to i+1, backward i to i-1."""
        if not ends:
            if forward_pass is None:
                self._gap_open.pop(phase, None)
            else:
                self._gap_open[phase] = (index, forward_pass, self._mark())
            return
        opened = self._gap_open.pop(phase, None)
        if opened is not None and opened[0] + (1 if phase == "forward" else -1) == index and opened[1] == forward_pass:
            self._gap_samples.append((phase, forward_pass, opened[2], self._mark()))

    def counters(self) -> dict[str, float]:
        return {"cpu_slowdown": self.trackers["forward"].cpu_scale if self.trackers else 1.0,
                "copy_slowdown": self.trackers["forward"].copy_scale if self.trackers else 1.0}

    def _mark(self):
        """A point in the compute stream's time: a CUDA event, or the clock where work is synchronous."""
        if self._device is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            return event
        return time.perf_counter()

    def _learn(self) -> None:
        """Feeds the copy timings and gaps since the last pass (complete by now) to the cost trackers, each pass's
        gaps at once for its batch size; each phase's first pass with gaps at a batch size is dropped (its buffers
        grow, its kernels load: a chain the estimate would keep for steps)."""
        samples, self._copy_samples = self._copy_samples, []
        gaps, self._gap_samples = self._gap_samples, []
        self._gap_open.clear()
        if self.trackers is None:
            return
        passes: dict[tuple[str, int], list[float]] = {}
        for phase, forward_pass, begin, end in gaps:
            passes.setdefault((phase, forward_pass), []).append(seconds_between(begin, end))
        for (phase, forward_pass), seconds in passes.items():
            size, gpu_only = self._passes.get(forward_pass, (0, True))
            first = (phase, size) not in self._gaps_seen
            self._gaps_seen.add((phase, size))
            if not gpu_only and not first:
                with self.lock:
                    self.trackers[phase].observe_serial(seconds, size)
        for phase, experts, timing in samples:  # long done: the layer's compute waited for them
            seconds = timing if isinstance(timing, float) else seconds_between(*timing)
            with self.lock:
                self.trackers[phase].observe((), 0.0, experts, seconds)


def seconds_between(begin, end) -> float:
    """Seconds from mark ``begin`` to mark ``end`` (host clock readings, or CUDA timing events, waited for here)."""
    if isinstance(end, float):
        return end - begin
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def mark_done(mark) -> bool:
    """Whether the device has passed mark ``mark`` (a clock reading has)."""
    return isinstance(mark, float) or mark.query()


def default_costs(device: torch.device, layer) -> tuple[SideCosts, SideCosts]:
    """First (forward, backward) costs for ``layer`` (the model's first) from nominal rates of the machine kind at
    hand (a CUDA GPU on PCIe Gen5; the CPU device standing in for one); measured passes correct them."""
    weights = layer.weights
    hidden, inter = weights.hidden_size, weights.intermediate_size
    if device.type == "cuda":
        rates = dict(dram_gbps=100.0, cpu_tflops=3.0, pcie_gbps=50.0, gpu_tflops=400.0)
    else:  # no link: "copies" are host copies, and the same CPU runs both sides
        rates = dict(dram_gbps=20.0, cpu_tflops=0.2, pcie_gbps=20.0, gpu_tflops=0.2)
    rank = max((part.rank for part in layer.lora() if part is not None), default=0)
    return (physical_costs(hidden, inter, rank, **rates), physical_costs(hidden, inter, rank, backward=True, **rates))
