"""Hybrid's counters: how each layer pass divided its experts, and the totals ``metrics_since_reset`` reports."""
from __future__ import annotations

from dataclasses import dataclass

from .hybrid_split import hit_rate


@dataclass
class SideMetrics:
    """How layer passes split their experts since the last reset (forward passes; experts and routed pairs)."""

    cpu_experts: int = 0
    cpu_pairs: int = 0
    gpu_experts: int = 0
    gpu_pairs: int = 0
    layer_passes: int = 0
    both_sides: int = 0  # layer passes that ran on both sides
    prefetch_hits: float = 0.0  # summed over forwards: the share of their pairs the prefetch put on the GPU
    prefetched_forwards: int = 0
    moved_experts: int = 0  # experts whose forward ran on the CPU and whose backward runs on the GPU
    gpu_only_steps: int = 0  # training steps the policy ran with every expert on the GPU


def record_forward(engine, layer, counts: list[int], gpu: tuple, cpu: tuple, gpu_backward: tuple) -> None:
    """Metrics, the policy's and the cache's observations, once per real (not recomputed) forward of a layer."""
    s = engine.sides
    s.layer_passes += 1
    s.both_sides += bool(gpu and cpu)
    s.cpu_experts += len(cpu)
    s.cpu_pairs += sum(counts[e] for e in cpu)
    s.gpu_experts += sum(1 for e in gpu if counts[e] > 0)
    s.gpu_pairs += sum(counts[e] for e in gpu)
    planned = engine.planned.get(layer.index)
    if planned is not None:
        s.prefetch_hits += hit_rate(planned, counts)
        s.prefetched_forwards += 1
    engine.metrics.add_expert_counts(counts)
    engine.metrics.tokens_routed += sum(counts)
    engine.split.layer_ran(layer.index, counts, bool(cpu), bool(set(cpu) - set(gpu_backward)))
    if engine.slots.cache is not None:  # its refill keeps the most routed experts (offload feeds it the same way)
        engine.slots.cache.observe(layer.index, counts)
    s.moved_experts += len(gpu_backward) - len(gpu)
    layer.last_gpu, layer.last_cpu = gpu_backward, bool(cpu)


def hybrid_counters(engine) -> dict[str, float]:
    """Offload's keys (``copy_s``, ``gpu_wait_s``, ...) plus each side's work: ``cpu_experts_s`` (CPU seconds),
    ``cpu_experts`` / ``gpu_experts`` and ``cpu_pairs`` / ``gpu_pairs`` (summed over layer passes),
    ``cpu_wait_s``, ``both_sides_share`` (layer passes split between both sides), ``device_wait_share`` (of them,
    forwards whose CPU part the device waited for on its own: ``CpuDone``), ``backward_device_wait_share`` (the
    same for backwards), ``moved_experts`` (CPU experts in forward whose backward ran on the GPU, summed),
    ``cold_cpu_parts`` (CPU parts during which the backend's buffer pools grew, left out of the cost fit),
    ``gpu_only_steps`` (training steps the policy ran with every expert on the GPU), ``prefetch_hit_rate`` and the
    policy's ``cpu_slowdown`` / ``copy_slowdown`` (measured over predicted seconds). The waits: ``copy_wait_s`` (the
    device stalled for copies: offload's ``gpu_wait_s``), ``device_cpu_wait_s`` (the device stalled for CPU parts
    it waited for itself), ``cpu_wait_s`` (the host blocked on CPU parts) and ``gpu_wait_s``, their sum."""
    out = engine.slots.counters_since_reset()
    s, cpu = engine.sides, engine.cpu_part.metrics
    staging, mark = engine.cpu_part.staging, engine._bytes_mark_staging
    device_cpu_wait_s = cpu.device_wait_events.seconds()
    passes = s.layer_passes
    out.update({
        "copy_wait_s": out["gpu_wait_s"], "device_cpu_wait_s": device_cpu_wait_s,
        "gpu_wait_s": out["gpu_wait_s"] + device_cpu_wait_s + cpu.wait_s,
        "cpu_experts_s": cpu.cpu_s, "cpu_experts": float(s.cpu_experts), "gpu_experts": float(s.gpu_experts),
        "cpu_pairs": float(s.cpu_pairs), "gpu_pairs": float(s.gpu_pairs), "cpu_wait_s": cpu.wait_s,
        "both_sides_share": s.both_sides / passes if passes else 0.0,
        "prefetch_hit_rate": s.prefetch_hits / s.prefetched_forwards if s.prefetched_forwards else 0.0,
        "device_wait_share": cpu.device_waits / passes if passes else 0.0,
        "backward_device_wait_share": cpu.backward_device_waits / passes if passes else 0.0,
        "moved_experts": float(s.moved_experts), "cold_cpu_parts": float(cpu.cold_parts),
        "gpu_only_steps": float(s.gpu_only_steps),
    })
    out.update(engine.split.counters())
    out["h2d_gb"] += (staging.bytes_to_device - mark[0]) / 1e9
    out["d2h_gb"] += (staging.bytes_to_host - mark[1]) / 1e9
    return out
