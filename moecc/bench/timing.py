"""Timing a training step, and the few helpers both the benchmark runner and the rate measurements use.

The planner (``plan.py``) is arithmetic over what these time; nothing here imports it or the runner.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch.autograd import DeviceType

from ..losses import chunked_causal_lm_loss
from .shapes import SEQUENCE
_NOT_COMPUTE = ("Memcpy", "Memset")  # profiler names of device events that are copies, not kernels
_PROFILED_STEP_LIMIT_S = 10.0  # longer steps are not profiled again (the profiler slows a step down)


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one untimed call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gpu_kernel_busy_s(events) -> float:
    """Seconds in which the GPU ran at least one kernel, from profiler ``events``; copies and memsets are not
    counted, overlapping kernels count once."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not e.name.startswith(_NOT_COMPUTE)
                   and not getattr(e, "is_user_annotation", False))  # record_function ranges seen from the GPU
    busy, begin, end = 0.0, None, None
    for start, stop in spans:
        if end is None or start > end:
            if end is not None:
                busy += end - begin
            begin, end = start, stop
        else:
            end = max(end, stop)
    if end is not None:
        busy += end - begin
    return busy / 1e6  # profiler times are microseconds


def _profiled_kernel_s(step, model: torch.nn.Module, device: torch.device) -> float | None:
    """GPU kernel time of one ``step()`` under the profiler, or None where the profiler gives no kernels."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            synchronize(device)
        busy = gpu_kernel_busy_s(prof.events())
    except RuntimeError as error:  # a measurement aid: the row keeps its timings without it
        model.zero_grad(set_to_none=True)  # a step cut short leaves gradients behind
        warnings.warn(f"moecc bench: the profiled step failed ({str(error)[:200]}); no gpu_kernels_s", stacklevel=2)
        return None
    return busy if busy > 0 else None


def adamw(parameters, lr: float = 1e-5) -> torch.optim.AdamW:
    """AdamW over the trainable ones of ``parameters``, fused: the Hugging Face Trainer's default
    (``adamw_torch_fused``), and on host-resident LoRA factors about 4x faster than the for-each one. The
    for-each one where a parameter lives where the fused one cannot run (hf-offload's meta placeholders)."""
    params = [p for p in parameters if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, fused=True if fused else None)


def time_training(model: torch.nn.Module, device: torch.device, tokens: int, steps: int,
                  warmup: int = 1, max_seconds: float | None = None, profile_gpu: bool = True) -> dict:
    """Median step time and its breakdown over ``steps`` optimizer steps of ``tokens`` tokens each.

    The loss is :func:`moecc.losses.chunked_causal_lm_loss` for every paradigm, so no paradigm pays for the full
    logits tensor (15 GB at 8192 tokens for Qwen3's vocabulary). ``warmup`` untimed steps come first. With
    ``max_seconds``, fewer steps are timed (at least one) when ``steps`` of them would take longer than that,
    and fewer warm-up steps run (at least one) once they took longer than that. On CUDA, unless
    ``profile_gpu`` is False, one more step (of up to 10 s) runs under the profiler for ``gpu_kernels_s``, the
    time the GPU spent computing (copies excluded): a step close to it, or to the copy time, leaves nothing to
    hide.
    """
    optimizer = adamw(model.parameters())
    seq = min(tokens, SEQUENCE)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // seq), seq), device=device)

    def train_step() -> None:
        chunked_causal_lm_loss(model, ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    records, retries = _timed_steps(train_step, model, device, warmup, steps, max_seconds)
    row = _breakdown(records)
    step_s = row["step_s"]
    return {
        **row, "tokens_per_s": ids.numel() / step_s, "steps_timed": len(records),
        "tokens_timed": ids.numel(),  # ``tokens`` rounded down to whole sequences of 2048 above that
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        "alloc_retries_per_step": retries / len(records),
        "gpu_kernels_s": (_profiled_kernel_s(train_step, model, device)
                          if profile_gpu and device.type == "cuda" and step_s <= _PROFILED_STEP_LIMIT_S else None),
    }


def _timed_steps(train_step, model: torch.nn.Module, device: torch.device, warmup: int, steps: int,
                 max_seconds: float | None) -> tuple[list[tuple[float, dict]], int]:
    """``([(seconds, engine metrics)] of the timed steps, allocator retries during them)``."""
    engine = getattr(getattr(model, "moecc", None), "engine", None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records: list[tuple[float, dict]] = []
    retries_before = 0
    warm_s = 0.0
    for step in range(warmup + steps):
        if step == warmup and device.type == "cuda":
            retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        if 0 < step < warmup and max_seconds is not None and warm_s > max_seconds:
            continue  # warm-up steps past max_seconds (at least one runs)
        if records and max_seconds is not None and sum(r[0] for r in records) * (1 + 1 / len(records)) > max_seconds:
            break  # the next step would take the timed ones past max_seconds
        if engine is not None:
            engine.reset_metrics()
        synchronize(device)
        start = time.perf_counter()
        train_step()
        synchronize(device)
        step_s = time.perf_counter() - start
        metrics = engine.counters_since_reset() if engine is not None else {}  # one set of names on any device
        if step >= warmup:
            records.append((step_s, metrics))
        else:
            warm_s += step_s
    # cudaMalloc calls that failed and were retried after freeing the allocator's cache (each synchronises the
    # device): a budget cap that the step presses against shows here before it shows as out of memory.
    retries = (torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries_before
               if device.type == "cuda" else 0)
    return records, retries


def _breakdown(records: list[tuple[float, dict]]) -> dict:
    """The median step and the medians of the engine's metrics, as disjoint parts of the step."""
    step_s = statistics.median(r[0] for r in records)

    def median(key: str) -> float:
        return statistics.median(r[1].get(key, 0.0) for r in records)

    cpu_s, copy_s, wait_s = median("cpu_experts_s"), median("copy_s"), median("gpu_wait_s")
    expert_gpu_s = median("expert_compute_s")
    # Disjoint parts of the step for the stacked plot: what the device waited for (the CPU experts under
    # co-compute, expert copies under offload: copies it did not wait for were hidden), the expert math on
    # the device (offload), and the rest (attention, dense layers, head, optimizer, host overhead).
    if any("copy_wait_s" in r[1] for r in records):  # hybrid: the device waits for either, each timed
        copy_wait_s = median("copy_wait_s")
        cpu_wait_s = median("cpu_wait_s") + median("device_cpu_wait_s")
    else:
        cpu_wait_s = wait_s if cpu_s > 0 else 0.0
        copy_wait_s = wait_s if cpu_s == 0 else 0.0
    return {
        # the timed steps' range: a machine's speed can drift between steps, so a ratio is read against it
        "step_s": step_s, "step_min_s": min(r[0] for r in records), "step_max_s": max(r[0] for r in records),
        "cpu_experts_s": cpu_s, "pcie_s": copy_s, "gpu_wait_s": wait_s,
        "cpu_wait_s": cpu_wait_s, "copy_wait_s": copy_wait_s, "expert_compute_s": expert_gpu_s,
        "gpu_other_s": max(0.0, step_s - cpu_wait_s - copy_wait_s - expert_gpu_s),
        "h2d_gb": median("h2d_gb"), "d2h_gb": median("d2h_gb"),
        "h2d_gbps_while_copying": median("h2d_gb") / copy_s if copy_s > 0 else 0.0,
        # hybrid: the layer passes whose CPU part the device waited for itself, forward and backward, and the
        # experts whose forward ran on the CPU and whose backward ran on the GPU, and the CPU parts left out of the
        # cost fit because the backend's buffers grew during them, per step; whether the step guard ran the
        # step with every expert on the GPU (1) or with the splits (0)
        **{key: median(key) for key in ("device_wait_share", "backward_device_wait_share", "moved_experts",
                                        "cold_cpu_parts", "gpu_only_steps")
           if any(key in r[1] for r in records)},
        # each timed step in order, with the engine's counters of that step: a median of a few steps hides a
        # host that switches between a fast and a slow state (bench.json only, not the table)
        "steps": [{"step_s": seconds, **metrics} for seconds, metrics in records],
    }
