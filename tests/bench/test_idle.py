"""moecc.bench.idle: kernels, copies and idle time of a profiled step, and the host op behind each long gap."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from moecc.bench.idle import idle_report


def event(name: str, start: float, end: float, device=DeviceType.CUDA, annotation: bool = False):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)


def test_busy_idle_and_the_host_op_behind_each_long_gap():
    events = [
        event("step", 0, 10_000, DeviceType.CPU),
        event("aten::copy_", 1_000, 2_500, DeviceType.CPU),   # running when the first gap begins (innermost)
        event("Optimizer.step", 6_000, 9_900, DeviceType.CPU),
        event("gemm", 0, 1_000), event("gemm", 500, 1_200),     # overlapping kernels count once: 0-1200
        event("Memcpy HtoD (Pinned -> Device)", 1_100, 2_000),  # copies: 1100-2000, overlapping the kernels
        event("Memcpy DtoH (Device -> Pinned)", 2_000, 3_000),  # busy, but not a host-to-device copy
        event("moecc.offload.forward", 0, 10_000, annotation=True),  # a GPU-side user range: ignored
        event("Memset (Device)", 2_000, 2_100),
        event("gemm", 2_300, 6_000),
    ]
    report = idle_report(events, min_gap_us=500)
    assert report.span_s == pytest.approx(0.010)
    assert report.kernels_s == pytest.approx((1_200 + 3_700) / 1e6)
    assert report.copies_s == pytest.approx(900 / 1e6)
    # the device-to-host copy (2000-3000) keeps the GPU busy past the next kernel's start: the one gap is
    # 6000-10000, which began inside the optimizer step
    assert report.idle_s == pytest.approx(4_000 / 1e6)
    assert report.by_host_op == {"Optimizer.step": pytest.approx(0.004)}
    # without the device-to-host copy and the memset: a 300 us gap at 2000 too, inside aten::copy_
    events = [e for e in events if not e.name.startswith(("Memcpy DtoH", "Memset"))]
    report = idle_report(events, min_gap_us=500)
    assert report.idle_s == pytest.approx((300 + 4_000) / 1e6)
    assert report.by_host_op == {"Optimizer.step": pytest.approx(0.004)}  # 300 us is under min_gap_us
    assert idle_report(events, min_gap_us=100).by_host_op == {"Optimizer.step": pytest.approx(0.004),
                                                               "aten::copy_": pytest.approx(0.0003)}


def test_no_events_is_an_empty_report():
    report = idle_report([])
    assert (report.span_s, report.idle_s, report.by_host_op) == (0.0, 0.0, {})
