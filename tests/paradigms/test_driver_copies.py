"""moecc/paradigms/driver_copies.py, and offload's runs of experts copied through it."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moecc.experts import ExpertWeights
from moecc.paradigms.driver_copies import DriverCopies, run_copies
from moecc.paradigms.device_slots import Slot as _Slot, _copy_runs


def test_run_copies_name_each_runs_slices_and_refuse_other_tensors():
    """Each run [start, stop) is the bytes of the host slice, to the device slice at the same experts."""
    host, device = torch.randn(7, 3, 5).bfloat16(), torch.zeros(7, 3, 5, dtype=torch.bfloat16)
    copies = run_copies(device, host, [(0, 2), (4, 7)])
    assert copies == [(device[a:b].data_ptr(), host[a:b].data_ptr(), host[a:b].nbytes) for a, b in [(0, 2), (4, 7)]]
    for other in (torch.zeros(7, 3, 5), torch.zeros(7, 5, 3).transpose(1, 2), torch.zeros(6, 3, 5).bfloat16()):
        with pytest.raises(ValueError, match="two contiguous tensors of one shape and dtype"):
            run_copies(other, host, [(0, 1)])


def test_without_cuda_the_driver_is_not_used_and_says_why():
    copies = DriverCopies(torch.device("cpu"))
    assert not copies.usable and copies.reason == "no CUDA device"


class _FakeDriver:
    """Takes the copies it is given (``accepts``: whether this thread has a CUDA context) and does them with
    plain host copies, as the driver would on the copy stream."""

    usable = True

    def __init__(self, accepts: bool) -> None:
        self.accepts, self.queued = accepts, []

    def queue(self, stream, copies):
        if not self.accepts:
            return False
        self.queued.extend(copies)
        for to, source, nbytes in copies:
            ctypes.memmove(to, source, nbytes)
        return True


@pytest.mark.parametrize("accepts", [True, False], ids=["driver", "no-context-torch"])
def test_copy_runs_send_host_runs_through_the_driver_and_cached_experts_through_torch(accepts, monkeypatch):
    """Runs from host memory go to the driver as one list (gate/up, then down); an expert from the cache is
    copied by torch; where the driver refuses (no context on the thread) torch copies everything. Either way the
    slot holds exactly the experts of the runs."""
    weights = ExpertWeights(torch.randn(6, 8, 4).bfloat16(), torch.randn(6, 4, 4).bfloat16())
    slot = _Slot(torch.zeros(6, 8, 4, dtype=torch.bfloat16), torch.zeros(6, 4, 4, dtype=torch.bfloat16))
    cached = (torch.full((8, 4), 3.0).bfloat16(), torch.full((4, 4), 3.0).bfloat16())
    driver = _FakeDriver(accepts)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)  # a stand-in stream here
    _copy_runs(slot, weights, [(0, 2, None), (3, 4, cached), (4, 6, None)], stream=object(), driver=driver)
    assert len(driver.queued) == (4 if accepts else 0)
    for e in (0, 1, 4, 5):
        assert torch.equal(slot.gate_up[e], weights.gate_up[e]) and torch.equal(slot.down[e], weights.down[e])
    assert torch.equal(slot.gate_up[3], cached[0]) and not slot.gate_up[2].any() and not slot.down[2].any()


@pytest.mark.gpu
def test_driver_copies_land_on_the_gpu_like_torch_slices():
    """On CUDA the self-test passes and two runs of a pinned bf16 tensor land in their experts alone."""
    device = torch.device("cuda", torch.cuda.current_device())
    copies = DriverCopies(device)
    assert copies.usable, copies.reason
    host = torch.randn(8, 16, 32).bfloat16().pin_memory()
    out = torch.zeros(host.shape, dtype=host.dtype, device=device)
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    assert copies.queue(stream, run_copies(out, host, [(1, 3), (5, 6)]))
    stream.synchronize()
    expected = torch.zeros_like(host)
    expected[1:3], expected[5] = host[1:3], host[5]
    assert torch.equal(out.cpu(), expected)
