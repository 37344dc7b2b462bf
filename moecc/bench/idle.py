"""Where a profiled training step left the GPU idle, and what the host was doing then.

From the events of one step under ``torch.profiler`` (CPU and CUDA activities): the time the GPU ran kernels,
the time it copied host to device, the time it did nothing at all (no kernel, copy or memset), and for each
stretch of that idle time longer than ``min_gap_us`` the innermost host operation running when it began (on
any thread). A step whose kernels and copies both leave long gaps is bound by the host (launches,
synchronisations, the CPU optimizer); the operations at the start of the gaps name the culprits.
"""
from __future__ import annotations

import bisect
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


# How far back from a gap's start to look for the operation still running then: the innermost one started
# shortly before; a trace can hold a million host events, and a gap only needs a name.
_LOOK_BACK = 20_000


def _innermost_host_op(host_ops: list, starts: list[float], at: float) -> str:
    """The CPU operation with the latest start among those running at ``at`` ("(none)" when none is, within
    ``_LOOK_BACK`` events); ``host_ops`` sorted by start, ``starts`` their starts."""
    last = bisect.bisect_right(starts, at) - 1  # the latest operation started by then
    for index in range(last, max(-1, last - _LOOK_BACK), -1):
        if host_ops[index].time_range.end > at:
            return host_ops[index].name
    return "(none)"


def idle_report(events, min_gap_us: float = 500.0, top: int = 12) -> IdleReport:
    """The step's :class:`IdleReport` from profiler ``events`` (``prof.events()``); times are microseconds there."""
    device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    host_ops = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in host_ops]
    kernels = _merge([(e.time_range.start, e.time_range.end) for e in device
                      if not e.name.startswith(("Memcpy", "Memset"))])
    copies = _merge([(e.time_range.start, e.time_range.end) for e in device if e.name.startswith(_COPY_TO_DEVICE)])
    everything = [(e.time_range.start, e.time_range.end) for e in events]
    if not everything:
        return IdleReport(0.0, 0.0, 0.0, 0.0)
    begin, end = min(s for s, _ in everything), max(e for _, e in everything)
    # Busy: any device work, copies the other way and memsets included (the step waits for those too).
    busy = _merge([(e.time_range.start, e.time_range.end) for e in device])
    gaps, cursor = [], begin
    for start, stop in busy + [(end, end)]:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, stop)
    by_op: dict[str, float] = defaultdict(float)
    for start, stop in gaps:
        if stop - start >= min_gap_us:
            by_op[_innermost_host_op(host_ops, starts, start)] += (stop - start) / 1e6
    ranked = dict(sorted(by_op.items(), key=lambda item: -item[1])[:top])
    return IdleReport(span_s=(end - begin) / 1e6, kernels_s=_total(kernels) / 1e6, copies_s=_total(copies) / 1e6,
                      idle_s=_total(gaps) / 1e6, by_host_op=ranked)
