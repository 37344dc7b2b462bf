"""CpuDone: numbers published by one thread release waits of another (the host here, a CUDA stream on a GPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from moecc.paradigms.device_wait import CpuDone, _lazy_loading


def rerun_under_eager_loading(request) -> bool:
    """Runs this test again in a child pytest under ``CUDA_MODULE_LOADING=EAGER`` where this process's CUDA loads
    kernels lazily (device waits are off there; see ``moecc.paradigms.device_wait``) and asserts it passed there.
    Returns True when it did so (the caller returns), False when this process loads eagerly (the caller runs)."""
    torch.cuda.init()
    if not _lazy_loading():
        return False
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                            request.node.nodeid], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "CUDA_MODULE_LOADING": "EAGER"}, cwd=request.config.rootpath)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]
    return True


def test_a_wait_returns_only_once_its_number_and_every_earlier_one_are_published():
    done = CpuDone(torch.device("cpu"))
    assert not done.on_device  # no device: the caller waits
    first, second, third = done.issue(), done.issue(), done.issue()
    assert (second, third) == (first + 1, first + 2)
    released = []
    waiter = threading.Thread(target=lambda: (done.wait(second), released.append(time.monotonic())))
    waiter.start()
    done.publish(third)  # a later part finished first: it must not release the earlier ones' waits
    done.publish(second)
    time.sleep(0.1)
    assert not released and not done.published(second) and int(done._flag[0]) == 0
    published_at = time.monotonic()
    done.publish(first)  # now every number up to the third is published
    waiter.join(5)
    assert released and released[0] >= published_at
    assert done.published(third) and int(done._flag[0]) == third
    done.publish(first)  # again, and lower: the word never goes back
    assert int(done._flag[0]) == third


def test_numbers_are_stored_modulo_2_32_as_signed_words():
    from moecc.paradigms.device_wait import _as_int32

    assert [_as_int32(n) for n in (1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5)] == \
        [1, 2**31 - 1, -2**31, -1, 0, 5]
    done = CpuDone(torch.device("cpu"))
    done._issued = done._published = 2**32 + 1  # as after that many parts
    done.publish(done.issue())
    assert int(done._flag[0]) == 2


def test_release_all_publishes_every_number_handed_out():
    done = CpuDone(torch.device("cpu"))
    numbers = [done.issue() for _ in range(3)]
    done.release_all()
    assert all(done.published(n) for n in numbers)
    done.wait(numbers[-1])  # returns at once


@pytest.mark.gpu
def test_a_stream_waits_on_the_device_until_the_host_publishes(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if rerun_under_eager_loading(request):
        return
    device = torch.device("cuda", torch.cuda.current_device())
    done = CpuDone(device)
    assert done.on_device, f"no device-side wait on this GPU: {done.reason}"
    stream = torch.cuda.Stream(device)
    number = done.issue()
    x = torch.ones(1024, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        done.wait(number)
        y = x * 2
        after = stream.record_event()
    time.sleep(0.1)  # the device reaches the wait: a store to a word it already waits on must release it
    assert not after.query()  # held back on the device, while this thread went on
    done.publish(number)
    after.synchronize()
    assert torch.equal(y, torch.full_like(x, 2))


def test_a_device_wait_that_fails_falls_back_to_waiting_here_with_a_warning(monkeypatch):
    done = CpuDone(torch.device("cpu"))
    done.on_device = True  # as after a passed self-test; then the driver call fails

    def broken(stream, number):
        raise RuntimeError("cuStreamWaitValue32 failed with CUDA driver error 1")

    monkeypatch.setattr(done, "_queue", broken)
    number = done.issue()
    threading.Timer(0.05, done.publish, args=(number,)).start()
    with pytest.warns(RuntimeWarning, match="no longer wait for the CPU on its own.*driver error 1"):
        done.wait(number, stream=object())
    assert done.published(number) and not done.on_device


@pytest.mark.gpu
def test_lazy_kernel_loading_turns_device_waits_off_with_the_reason():
    """A kernel loaded at its first launch behind a pending wait deadlocks with the publishing worker (the host's
    hang): under lazy loading the caller waits instead, and says how to turn device waits on."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.init()
    done = CpuDone(torch.device("cuda", torch.cuda.current_device()))
    if _lazy_loading():
        assert not done.on_device and "CUDA_MODULE_LOADING=EAGER" in done.reason
    else:
        assert done.on_device, done.reason
