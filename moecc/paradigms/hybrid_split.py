"""Which of a layer's routed experts the hybrid paradigm runs on the GPU and which on the CPU: pure arithmetic.

Three resources work on one layer pass at once — the CPU (cold experts, in place), the copy engine (hot experts'
weights to the GPU) and the GPU (the hot experts' math) — so a pass costs about the busiest of the three, plus a
fixed cost for running both sides (submit, sync, merge). The GPU's own work between two layers' experts
(attention, router) comes before either side's expert work and overlaps only the copies: a pass costs
max(serial + max(CPU, GPU), copy) (``serial_s``, measured). With experts sorted by tokens, most first, the GPU takes
a prefix: the split is the prefix length that minimises that cost. Experts already on the GPU (cached) cost no
copy and come first in that order; experts a prefetch copied for this pass come next, their copies charged
(the copy engine is the pipeline's shared resource: a copy made for this layer delays the next layer's). A prefix
of zero or of every routed expert is a pure paradigm, taken where a split does not pay.

The per-expert costs come from rates measured while both sides run (``SideCosts``), and are corrected online by
``CostTracker`` from each pass's measured CPU and copy seconds, so a split planned from rates measured apart (which
lost to plain streaming in other engines) is replaced by what this machine does under contention.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class SideCosts:
    """Seconds per layer pass (forward or backward) of each side's work, as a function of what it gets."""

    cpu_expert_s: float  # an active expert's fixed CPU cost: its weights read from DRAM, its tasks
    cpu_token_s: float  # each routed (token, expert) pair on the CPU
    copy_expert_s: float  # one expert's weights over PCIe, at the rate achieved while the CPU computes
    gpu_expert_s: float  # an active expert on the GPU (its grouped-product share, launch)
    gpu_token_s: float  # each routed pair on the GPU
    # A pass that runs on both sides: staging, the CPU's result back, the sum, the device's wait for the CPU
    # part's chain; what a GPU machine's bench lost per split pass beyond the copies the CPU saved
    both_sides_s: float = 1.2e-3
    cpu_call_s: float = 0.0  # a CPU part at all: its staging, gathers and scatters, the pool's start
    # The GPU's own work between one layer's experts and the next's (attention, router, staging): both sides'
    # expert work waits for it (the next layer needs its output), only the copies overlap it
    serial_s: float = 0.0

    def cpu_s(self, counts: Iterable[int]) -> float:
        """CPU seconds for experts with these token counts (experts with none cost nothing, nor a CPU part
        with none)."""
        active = [n for n in counts if n > 0]
        if not active:
            return 0.0
        return self.cpu_call_s + len(active) * self.cpu_expert_s + sum(active) * self.cpu_token_s

    def gpu_s(self, counts: Iterable[int]) -> float:
        active = [n for n in counts if n > 0]
        return len(active) * self.gpu_expert_s + sum(active) * self.gpu_token_s


@dataclass(frozen=True)
class Split:
    """One layer pass's placement: ``gpu`` experts (sorted) run on the GPU, every other routed expert on the CPU."""

    gpu: tuple[int, ...]
    predicted_s: float
    cpu_s: float
    copy_s: float
    gpu_s: float


def plan_split(counts: Sequence[int], costs: SideCosts, resident: Iterable[int] = (),
               committed: Iterable[int] = (), then: SideCosts | None = None, required: Iterable[int] = (),
               recompute: SideCosts | None = None) -> Split:
    """The GPU set minimising max(serial + max(CPU, GPU), copy) seconds (+ ``both_sides_s`` when both work) for a
    pass whose experts get ``counts[e]`` tokens. ``resident`` experts are on the GPU already (cached: no copy);
    ``committed`` ones were copied for this pass already (a prefetch): their copies are charged whatever runs
    where, since the copy engine spent that time on this layer, and they run on the GPU first. ``then``: the
    costs of a later pass that runs the same split (backward after forward, copying its GPU experts again), whose
    seconds are added to the score; the returned seconds are the first pass's. ``required`` experts run on the GPU
    whatever they cost (a backward's experts whose forward ran there: the CPU holds no state of theirs); with
    ``recompute`` (the forward's costs) a split taking more than those pays the GPU's forward of all of its
    experts first (the moved ones' saved state is made again from the GPU part's hidden states).

    O(E log E): experts sorted by tokens (resident and committed ones first, they cost no further copy), every
    prefix scored at once from cumulative sums (numpy: this runs on every layer call's critical path).
    """
    resident, required = set(resident), set(required)
    committed = set(committed) - resident
    order = sorted((e for e, n in enumerate(counts) if n > 0),
                   key=lambda e: (e not in required, e not in resident, e not in committed, -counts[e], e))
    tokens = np.array([counts[e] for e in order], dtype=np.float64)
    in_resident = np.array([e in resident for e in order], dtype=bool)
    in_committed = np.array([e in committed for e in order], dtype=bool)
    total = np.zeros(len(order) + 1)
    needed = sum(1 for e in order if e in required)
    first = None
    for later, c in enumerate([costs] if then is None else [costs, then]):
        copied = ~in_resident if later else ~(in_resident | in_committed)
        parts = _prefix_parts(c, tokens, copied, 0.0 if later else len(committed) * c.copy_expert_s)
        if not later and recompute is not None and needed:
            moved = _prefix_parts(c, tokens, copied, len(committed) * c.copy_expert_s,
                                  recompute_s=_gpu_prefix_s(recompute, tokens))
            parts = tuple(np.concatenate((a[:needed + 1], b[needed + 1:])) for a, b in zip(parts, moved))
        total += parts[0]
        first = parts if first is None else first
    total[:needed] = np.inf  # prefixes that leave a required expert on the CPU
    m = int(np.lexsort((np.arange(total.size), first[1], total))[0])  # ties: the smaller CPU part, then fewer
    return Split(tuple(sorted(order[:m])), *(float(part[m]) for part in first))


def _prefix_parts(c: SideCosts, tokens: np.ndarray, copied: np.ndarray, committed_s: float,
                  recompute_s: np.ndarray | float = 0.0) -> tuple:
    """(seconds, CPU, copy, GPU seconds) of a pass with the first m experts of ``tokens`` on the GPU, for every
    m from 0 to all of them; ``recompute_s``: GPU seconds the pass spends first (per m, or one figure)."""
    m = np.arange(tokens.size + 1)
    cpu_total = c.cpu_s(tokens.tolist())
    cpu_left = cpu_total - np.concatenate(([0.0], np.cumsum(c.cpu_expert_s + tokens * c.cpu_token_s)))
    copy = committed_s + np.concatenate(([0.0], np.cumsum(np.where(copied, c.copy_expert_s, 0.0))))
    gpu = recompute_s + _gpu_prefix_s(c, tokens)
    # The pure CPU pass (m = 0) has no CPU-call floor beyond its own cost; a pass with every expert on the GPU none.
    cpu_part = np.where(m == tokens.size, 0.0, np.where(m == 0, cpu_left, np.maximum(cpu_left, c.cpu_call_s)))
    busy = cpu_part > 0.0
    seconds = np.maximum(c.serial_s + np.maximum(cpu_part, gpu), copy) + np.where(busy & (m > 0), c.both_sides_s, 0.0)
    return seconds, cpu_part, copy, gpu


def _gpu_prefix_s(c: SideCosts, tokens: np.ndarray) -> np.ndarray:
    """GPU seconds of the first m experts of ``tokens``, for every m."""
    return np.concatenate(([0.0], np.cumsum(c.gpu_expert_s + tokens * c.gpu_token_s)))


@dataclass
class RoutingForecast:
    """Per-layer tokens per expert expected in the next forward pass: an exponential average of the passes seen
    (forward copies must start a layer ahead, before the layer's router has run)."""

    decay: float = 0.5  # weight of the newest pass
    counts: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, layer: int, counts: Sequence[int]) -> None:
        old = self.counts.get(layer)
        if old is None or len(old) != len(counts):
            self.counts[layer] = [float(n) for n in counts]
        else:
            self.counts[layer] = [self.decay * n + (1 - self.decay) * o for n, o in zip(counts, old)]

    def expected(self, layer: int) -> list[float] | None:
        """The forecast for ``layer``, or None before its first pass."""
        return self.counts.get(layer)


def hit_rate(predicted_gpu: Iterable[int], counts: Sequence[int]) -> float:
    """Share of a pass's routed pairs that landed on experts the forecast had sent to the GPU: how good the
    prefetch was (1.0: every pair the plan meant for the GPU found its expert there)."""
    total = sum(counts)
    if total == 0:
        return 1.0
    return sum(counts[e] for e in set(predicted_gpu) if e < len(counts)) / total


@dataclass
class CostTracker:
    """Costs corrected from what passes measured, so the split follows the rates this machine achieves with
    both sides running. CPU: measured seconds of each CPU part fitted as ``fixed + scale * predicted`` by
    exponentially weighted least squares (the fixed part is per call: staging, gathers, the pool's start), with
    a prior on the scale (``_fit_line``); copies: a scale factor (measured / predicted seconds), exponentially
    averaged; the serial gap: per batch size, from each pass's median gap (``observe_serial``)."""

    base: SideCosts
    decay: float = 0.3
    cpu_scale: float = 1.0
    cpu_fixed_s: float = 0.0
    copy_scale: float = 1.0
    # Measured SideCosts.serial_s per batch size (the attention's share grows with the tokens), and the one
    # measured last (a size not measured yet plans with it; None until a pass measured any)
    serial_by_size: dict[int, float] = field(default_factory=dict)
    serial_s: float | None = None
    serial_rise: float = 0.5  # share of the way to a pass's longer gaps the estimate moves
    serial_fall: float = 0.1  # ... and to its shorter ones
    samples: int = 0
    # Layer passes without a CPU part since the last one with (``ran``)
    idle_passes: int = 0
    probe_after: int = 0  # 0: never
    _sums: list = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, x*x, x*y of the CPU fit
    # The last CPU samples fitted, (predicted by the first costs, measured) seconds beyond a call's: diagnostics
    recent: deque = field(default_factory=lambda: deque(maxlen=512))

    def costs(self, size: int | None = None) -> SideCosts:
        """The fitted costs, with the serial gap measured for batch size ``size``."""
        b = self.base
        serial = self.serial_by_size.get(size, self.serial_s)
        return replace(b, cpu_expert_s=b.cpu_expert_s * self.cpu_scale, cpu_token_s=b.cpu_token_s * self.cpu_scale,
                       cpu_call_s=b.cpu_call_s + self.cpu_fixed_s, copy_expert_s=b.copy_expert_s * self.copy_scale,
                       serial_s=b.serial_s if serial is None else serial)

    def ran(self, cpu_part: bool) -> None:
        """A layer pass ran with or without a CPU part. After ``probe_after`` passes without, the CPU fit starts
        over from its slope alone (fixed part and samples dropped): the next plans take a CPU part where the slope
        allows one, and its samples fit the costs again, where passes without a CPU part teach it nothing."""
        if cpu_part:
            self.idle_passes = 0
            return
        self.idle_passes += 1
        if self.idle_passes == self.probe_after:
            self.cpu_fixed_s, self._sums = 0.0, [0.0] * 5

    def observe_serial(self, gaps: Sequence[float], size: int = 0) -> None:
        """One pass's measured gaps between a layer's expert result and the next layer's expert inputs on the GPU,
        at batch size ``size``.
        The estimate follows their median up quickly and down slowly: a pass whose device waited on copies
        measures only the GPU's share of the gap, the host's (the routing brought to the host, the CPU part's
        staging) hidden behind the copies, while a pass that waited on the CPU measures the chain a CPU part is
        on. Followed alike, each kind of pass planned the other kind next, and the splits swung between copy-bound
        and CPU-bound steps."""
        gaps = [g for g in gaps if g >= 0]
        if not gaps:
            return
        median = statistics.median(gaps)
        estimate = self.serial_by_size.get(size)
        if estimate is None:
            estimate = median
        else:
            estimate += (self.serial_rise if median > estimate else self.serial_fall) * (median - estimate)
        self.serial_by_size[size] = self.serial_s = estimate

    def observe(self, cpu_counts: Sequence[int], cpu_s: float, copied_experts: int, copy_s: float) -> None:
        """One pass's CPU part (its experts' token counts, measured seconds) and copies (experts, seconds)."""
        predicted_cpu = self.base.cpu_s(cpu_counts) - self.base.cpu_call_s
        beyond_call = cpu_s - self.base.cpu_call_s  # the fit's fixed part is what a call costs beyond the base's
        if predicted_cpu > 0 and beyond_call > 0:
            self._fit_cpu(predicted_cpu, beyond_call)
        if copied_experts > 0 and copy_s > 0 and self.base.copy_expert_s > 0:
            self.copy_scale = _blend(self.copy_scale, copy_s / (copied_experts * self.base.copy_expert_s), self.decay)
        self.samples += 1

    def _fit_cpu(self, x: float, y: float) -> None:
        keep = 1 - self.decay / 4  # the fit keeps a longer memory than the copy scale: two unknowns, noisy
        predicted = self.cpu_fixed_s + self.cpu_scale * x
        y = min(max(y, predicted / 4), predicted * 4)  # one odd pass (a descheduled thread) moves the fit little
        self.recent.append((x, y))
        self._sums = [keep * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]
        self.cpu_fixed_s, self.cpu_scale = _fit_line(*self._sums)


def _fit_line(w: float, sx: float, sy: float, sxx: float, sxy: float) -> tuple[float, float]:
    """(fixed, scale) of ``y = fixed + scale * x`` by weighted least squares with a prior, of a tenth of a
    sample's weight, that the scale is 1 (the first costs' slope), fixed >= 0 and scale >= 0.05. Parts of one size cannot tell
    the two apart: the prior then puts their excess in the fixed part. Put in the slope, as a pure ratio did, it
    priced larger CPU parts out of every plan, so no sample of another size ever came to correct it; in the
    fixed part, the plans try larger parts, whose samples then fit the slope."""
    if w <= 0 or sx <= 0:
        return 0.0, 1.0
    prior = 0.1 * (sx / w) ** 2  # the penalty's weight: a tenth of a sample at the mean size
    # Normal equations: w f + sx s = sy;  sx f + (sxx + prior) s = sxy + prior
    det = w * (sxx + prior) - sx * sx
    fixed = (sy * (sxx + prior) - sx * (sxy + prior)) / det
    scale = (w * (sxy + prior) - sx * sy) / det
    if fixed < 0:
        fixed, scale = 0.0, (sxy + prior) / (sxx + prior)
    if scale < 0.05:
        scale = 0.05
        fixed = max(0.0, (sy - scale * sx) / w)
    return fixed, scale


def _blend(old: float, new: float, decay: float) -> float:
    new = min(max(new, old / 4), old * 4)  # one odd pass (a page fault storm, a descheduled thread) moves it little
    return (1 - decay) * old + decay * new


def physical_costs(hidden: int, inter: int, rank: int, dram_gbps: float, cpu_tflops: float, pcie_gbps: float,
                   gpu_tflops: float, backward: bool = False) -> SideCosts:
    """First costs for a layer shape from machine rates: an active expert reads its 3·H·I bf16 weights once per
    pass (from DRAM on the CPU, over PCIe to the GPU); each pair costs 6·H·I (+ LoRA) FLOPs forward, and backward
    about as many again plus the LoRA gradients, so twice the forward's per-pair cost is used."""
    weight_bytes = 3 * hidden * inter * 2
    pair_flops = 6 * hidden * inter + 2 * rank * (2 * hidden + 3 * inter) * 3
    factor = 2.0 if backward else 1.0
    return SideCosts(
        cpu_expert_s=weight_bytes / (dram_gbps * 1e9) + 2e-5,
        cpu_token_s=factor * pair_flops / (cpu_tflops * 1e12),
        copy_expert_s=weight_bytes / (pcie_gbps * 1e9),
        gpu_expert_s=1.5e-5,
        gpu_token_s=factor * pair_flops / (gpu_tflops * 1e12),
    )
