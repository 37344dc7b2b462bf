"""Which parts of a device-side wait for the CPU work on this machine, each in its own process under a watchdog.

A stream that waits for a word in pinned memory (``CpuDone``) and never sees it written hangs every later sync of
the device. On the accelerator host every case whose thread launched a kernel for the first time behind a pending
wait hung: under lazy kernel loading (torch's default) that launch waits for the queued work, the wait included
(``benchmarks/results/host_2026-12-02_s18``). A case name may end in ``_warm`` (the kernels it queues behind the
wait launched once before), and ``NAME@eager`` runs it under ``CUDA_MODULE_LOADING=EAGER``. Each case runs in a
child process killed after ``--timeout`` seconds (a CUDA start takes 13-18 s there) and prints ``ok``, ``failed``
(with the error) or ``HANG``:

- ``raw_spin_kernel``: the alternative to the driver's wait, a one-thread PTX kernel polling the word (with a
  give-up time, so it cannot hang): held, released by a host store, and the release latency;
- ``self_test``: ``CpuDone(device)`` and its self-test (queue a wait, see it held, publish, see it released);
- ``raw_torch_pinned`` / ``raw_host_alloc``: the driver calls alone, on a word in torch's pinned memory and on one
  from ``cuMemHostAlloc(DEVICEMAP)`` through ``cuMemHostGetDevicePointer``: held, released by a host store, and
  (if not) by a device write from another stream;
- ``host_publish``: a wait queued on a side stream, published by this thread once the device is at the wait;
- ``host_publish_null_stream``: the same on the legacy default stream;
- ``worker_publish_sync``: published by a worker thread while this thread is in ``torch.cuda.synchronize()``;
- ``worker_publish_item``: the same while this thread reads ``.item()`` of a result behind the wait;
- ``worker_publish_empty_cache``: the same while this thread calls ``torch.cuda.empty_cache()`` (``cudaFree``);
- ``worker_publish_pinned``: the same while this thread allocates pinned host memory.

    python benchmarks/probe_device_wait.py --timeout 35
    python benchmarks/probe_device_wait.py --timeout 35 --cases host_publish,host_publish_warm,host_publish@eager
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time

CASES = ["raw_spin_kernel", "self_test", "raw_torch_pinned", "raw_host_alloc", "host_publish",
         "host_publish_null_stream", "worker_publish_sync", "worker_publish_item", "worker_publish_empty_cache",
         "worker_publish_pinned"]
_WORD = 1 << 32


_T0 = time.perf_counter()


def say(*parts) -> None:
    print(f"[{time.perf_counter() - _T0:.2f}s]", *parts, flush=True)


def raw_case(name: str) -> None:
    """The driver's wait on one word, no moecc code: which memory a stream can wait on here."""
    import torch

    from moecc.paradigms.device_wait import _driver_wait, _settles

    wait, write, *_ = _driver_wait()
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    if name == "raw_torch_pinned":
        word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        host, device = word.data_ptr(), word.data_ptr()
    else:
        from moecc.paradigms.device_wait import _libcuda

        lib = _libcuda()
        pointer, device_pointer = ctypes.c_void_p(), ctypes.c_uint64()
        say("cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(pointer), ctypes.c_size_t(64), ctypes.c_uint(3)))
        say("cuMemHostGetDevicePointer", lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_pointer), pointer,
                                                                          ctypes.c_uint(0)))
        host, device = pointer.value, device_pointer.value
        ctypes.c_int32.from_address(host).value = 0
    say(f"host {host:#x} device {device:#x}")
    reached = stream.record_event()
    say("wait queued:", wait(ctypes.c_void_p(stream.cuda_stream), device, 1, 0))
    after = stream.record_event()
    say("device at the wait:", _settles(reached, 3.0))
    time.sleep(0.1)  # a store to a word the device already polls, not one made before it got there
    say("held:", not after.query())
    ctypes.c_int32.from_address(host).value = 1
    released = _settles(after, 3.0)
    say("released by the host store:", released)
    if not released:
        say("device write queued:", write(ctypes.c_void_p(other.cuda_stream), device, 1, 0))
        say("released by a device write:", _settles(after, 3.0))


# A kernel of one thread that polls the word until it reaches the target (the cyclic comparison of the memop), or
# gives up after timeout_ns and sets *timed_out: a stream behind it can never stay blocked for good.
_SPIN_PTX = b"""
.version 6.5
.target sm_70
.address_size 64
.visible .entry moecc_wait_word(.param .u64 word, .param .u32 target, .param .u64 timeout_ns,
                                .param .u64 timed_out)
{
    .reg .pred %p<3>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [word];
    ld.param.u32 %r1, [target];
    ld.param.u64 %rd2, [timeout_ns];
    ld.param.u64 %rd3, [timed_out];
    mov.u64 %rd4, %globaltimer;
POLL:
    ld.volatile.u32 %r2, [%rd1];
    sub.s32 %r3, %r2, %r1;
    setp.ge.s32 %p1, %r3, 0;
    @%p1 bra DONE;
    mov.u64 %rd5, %globaltimer;
    sub.u64 %rd6, %rd5, %rd4;
    setp.gt.u64 %p2, %rd6, %rd2;
    @%p2 bra GAVE_UP;
    nanosleep.u32 200;
    bra POLL;
GAVE_UP:
    st.volatile.u32 [%rd3], 1;
DONE:
    ret;
}
"""


class SpinKernel:
    """``moecc_wait_word`` loaded into the current context through the driver API (no compiler needed: the driver
    compiles the PTX for its GPU). ``launch(stream, word, target, timeout_s, timed_out)`` queues it."""

    def __init__(self) -> None:
        from moecc.paradigms.device_wait import _libcuda

        lib = _libcuda()
        if lib is None:
            raise RuntimeError("the CUDA driver library is not loaded in this process")
        self._lib = lib
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        result = lib.cuModuleLoadData(ctypes.byref(module), _SPIN_PTX)
        if result != 0:
            raise RuntimeError(f"cuModuleLoadData failed with CUDA driver error {result}")
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        result = lib.cuModuleGetFunction(ctypes.byref(function), module, b"moecc_wait_word")
        if result != 0:
            raise RuntimeError(f"cuModuleGetFunction failed with CUDA driver error {result}")
        self._module, self._function = module, function
        launch = getattr(lib, "cuLaunchKernel")
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                      ctypes.POINTER(ctypes.c_void_p),
                                                                      ctypes.c_void_p]
        launch.restype = ctypes.c_int
        self._launch = launch

    def launch(self, stream_handle: int, word: int, target: int, timeout_s: float, timed_out: int) -> None:
        args = (ctypes.c_uint64(word), ctypes.c_uint32(target % _WORD), ctypes.c_uint64(int(timeout_s * 1e9)),
                ctypes.c_uint64(timed_out))
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        result = self._launch(self._function, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream_handle), params, None)
        if result != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA driver error {result}")


def spin_case() -> None:
    """A one-thread kernel polling the pinned word (``SpinKernel``), with a 5 s give-up: held, then released."""
    import torch

    from moecc.paradigms.device_wait import _settles

    torch.cuda.init()
    word = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    kernel = SpinKernel()
    say("loaded")
    reached = stream.record_event()
    kernel.launch(stream.cuda_stream, word.data_ptr(), 1, 5.0, word.data_ptr() + 4)
    after = stream.record_event()
    say("device at the wait:", _settles(reached, 3.0))
    time.sleep(0.1)
    say("held:", not after.query())
    t = time.perf_counter()
    word.numpy()[0] = 1
    released = _settles(after, 6.0)
    say(f"released by the host store: {released} in {1e3 * (time.perf_counter() - t):.3f} ms, timed out flag "
        f"{int(word[1])}")
    # latency of a hold/release round trip, 20 times
    lat = []
    for n in range(2, 22):
        ev = stream.record_event()
        kernel.launch(stream.cuda_stream, word.data_ptr(), n, 5.0, word.data_ptr() + 4)
        after = stream.record_event()
        _settles(ev, 3.0)
        time.sleep(0.002)
        t = time.perf_counter()
        word.numpy()[0] = n
        _settles(after, 6.0)
        lat.append(1e6 * (time.perf_counter() - t))
    lat.sort()
    say(f"release latency us: median {lat[10]:.1f} min {lat[0]:.1f} max {lat[-1]:.1f}; timed out flag {int(word[1])}")


def run_case(name: str) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(15, exit=False)  # where a hang is, before the parent's watchdog kills it

    if name == "raw_spin_kernel":
        return spin_case()
    if name.startswith("raw_"):
        return raw_case(name)

    from moecc.paradigms.device_wait import CpuDone

    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    done = CpuDone(device)
    say(f"self-test: on_device={done.on_device} in {time.perf_counter() - start:.3f} s")
    if name == "self_test" or not done.on_device:
        return
    warm = name.endswith("_warm")  # every kernel the case launches behind the wait launched once before it
    name = name.removesuffix("_warm")
    null = name == "host_publish_null_stream"
    stream = torch.cuda.current_stream(device) if null else torch.cuda.Stream(device)
    say("stream handle", stream.cuda_stream)
    x = torch.ones(1 << 20, device=device)
    if warm:
        say("warm-up", float((x * 2).sum()))
    stream.wait_stream(torch.cuda.current_stream(device))
    number = done.issue()
    with torch.cuda.stream(stream):
        done.wait(number)
        say("wait queued")
        y = (x * 2).sum()
        say("kernels queued behind it")
    if not null:
        torch.cuda.current_stream(device).wait_stream(stream)  # the compute stream behind the wait, as in hybrid
    if name.startswith("host_publish"):
        time.sleep(0.1)
        say("held:", not stream.query())
        done.publish(number)
        print("value", float(y), flush=True)
        return
    publisher = threading.Thread(target=lambda: (time.sleep(0.2), done.publish(number)))
    publisher.start()
    if name == "worker_publish_sync":
        torch.cuda.synchronize()
    elif name == "worker_publish_item":
        print("value", y.item(), flush=True)
    elif name == "worker_publish_empty_cache":
        del x
        torch.cuda.empty_cache()
    elif name == "worker_publish_pinned":
        torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    publisher.join()
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated; a case name may end in _warm, and @eager runs it under "
                             "CUDA_MODULE_LOADING=EAGER")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("probe_device_wait.py: needs a CUDA GPU (it probes a GPU stream waiting for the CPU)")
    for name in args.cases.split(","):
        case, _, mode = name.partition("@")
        env = {**os.environ, **({"CUDA_MODULE_LOADING": "EAGER"} if mode == "eager" else {})}
        try:
            child = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True,
                                   timeout=args.timeout, env=env)
            status = "ok" if child.returncode == 0 else f"failed: {child.stderr.strip().splitlines()[-1:]}"
            detail = " | ".join(child.stdout.strip().splitlines())
        except subprocess.TimeoutExpired as expired:
            status, detail = "HANG", (expired.stdout or b"").decode(errors="replace").strip().replace("\n", " | ")
            stacks = (expired.stderr or b"").decode(errors="replace").strip().splitlines()
            detail += " | stacks: " + " / ".join(line.strip() for line in stacks[-12:])
        print(f"{name}: {status} ({detail})", flush=True)


if __name__ == "__main__":
    main()
