"""Where a profiled training step left the GPU idle, and what the host was doing then.

From the events of one step under ``torch.profiler`` (CPU and CUDA activities): the time the GPU ran kernels,
the time it copied host to device, the time it did neither, and for each stretch of that idle time longer than
``min_gap_us`` the innermost host operation running when it began. A step whose kernels and copies both leave
long gaps is bound by the host (launches, synchronisations, the CPU optimizer); the operations at the start of
the gaps name the culprits.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch.autograd import DeviceType

_COPY_TO_DEVICE = "Memcpy HtoD"


@dataclass
class IdleReport:
    """Seconds of one profiled step: its span, kernels, host-to-device copies, neither (``idle_s``), and the
    idle seconds by the host operation running when each long gap began (``by_host_op``, largest first)."""

    span_s: float
    kernels_s: float
    copies_s: float
    idle_s: float
    by_host_op: dict[str, float] = field(default_factory=dict)


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _total(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _innermost_host_op(host_ops: list, at: float) -> str:
    """The CPU operation with the latest start among those running at ``at`` ("(none)" when none is)."""
    running = [e for e in host_ops if e.time_range.start <= at < e.time_range.end]
    return max(running, key=lambda e: e.time_range.start).name if running else "(none)"


def idle_report(events, min_gap_us: float = 500.0, top: int = 12) -> IdleReport:
    """The step's :class:`IdleReport` from profiler ``events`` (``prof.events()``); times are microseconds there."""
    device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    host_ops = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = _merge([(e.time_range.start, e.time_range.end) for e in device
                      if not e.name.startswith(("Memcpy", "Memset"))])
    copies = _merge([(e.time_range.start, e.time_range.end) for e in device if e.name.startswith(_COPY_TO_DEVICE)])
    everything = [(e.time_range.start, e.time_range.end) for e in events]
    if not everything:
        return IdleReport(0.0, 0.0, 0.0, 0.0)
    begin, end = min(s for s, _ in everything), max(e for _, e in everything)
    busy = _merge(kernels + copies)
    gaps, cursor = [], begin
    for start, stop in busy + [(end, end)]:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, stop)
    by_op: dict[str, float] = defaultdict(float)
    for start, stop in gaps:
        if stop - start >= min_gap_us:
            by_op[_innermost_host_op(host_ops, start)] += (stop - start) / 1e6
    ranked = dict(sorted(by_op.items(), key=lambda item: -item[1])[:top])
    return IdleReport(span_s=(end - begin) / 1e6, kernels_s=_total(kernels) / 1e6, copies_s=_total(copies) / 1e6,
                      idle_s=_total(gaps) / 1e6, by_host_op=ranked)
