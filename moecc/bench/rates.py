"""Measured machine rates the planner predicts from: DRAM read, CPU expert kernels, PCIe, GPU matmul.

Each is measured once (a few seconds in all) and cached as JSON, so ``moecc plan`` answers at once afterwards.
Rates that do not apply here (no GPU) are left out.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moecc" / "rates.json"


def _best_of(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def dram_read_gbps(gigabytes: float = 1.0) -> float:
    """Host memory read rate with torch's threads (a reduction over a buffer far larger than the caches)."""
    data = torch.ones(int(gigabytes * 1e9 / 4), dtype=torch.float32)
    return data.nbytes / _best_of(lambda: data.sum()) / 1e9


def cpu_expert_tflops(isa: str | None = None) -> float:
    """Forward + backward TFLOP/s of the native expert kernels on one mid-sized layer (uniform routing)."""
    from .. import _ops
    from ..native_experts import NativeExperts
    from ..reference import ExpertWeights

    experts, top_k, hidden, inter, tokens = 16, 4, 1024, 512, 512
    g = torch.Generator().manual_seed(0)
    owner = type("Owner", (), {})()
    weights = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16(),
                            (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16(), cache_owner=owner)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    index = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, generator=g)
    native = NativeExperts(isa or _ops.best_isa())
    grad = torch.randn(tokens, hidden, generator=g)

    def step():
        _, saved = native.forward(weights, x, index, w, None, None)
        native.backward(weights, saved, grad, None, None)

    return 2 * 6 * tokens * top_k * hidden * inter / _best_of(step) / 1e12


def pcie_gbps(device: torch.device, megabytes: int = 512) -> tuple[float, float]:
    """(host→device, device→host) GB/s of pinned copies."""
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    return host.nbytes / _best_of(h2d) / 1e9, host.nbytes / _best_of(d2h) / 1e9


def gpu_tflops(device: torch.device, size: int = 4096) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def matmul():
        a @ a
        torch.cuda.synchronize(device)

    return 2 * size**3 / _best_of(matmul) / 1e12


def measure(remeasure: bool = False, cache: Path | None = None) -> dict:
    """The machine's rates, from ``cache`` (default ``CACHE``) unless it is missing or ``remeasure`` is set."""
    cache = cache or CACHE
    if cache.is_file() and not remeasure:
        return json.loads(cache.read_text())
    rates = {"dram_gbps": dram_read_gbps(), "cpu_expert_tflops": cpu_expert_tflops()}
    if torch.cuda.is_available():
        device = torch.device("cuda")
        rates["h2d_gbps"], rates["d2h_gbps"] = pcie_gbps(device)
        rates["gpu_tflops"] = gpu_tflops(device)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rates, indent=2))
    return rates
