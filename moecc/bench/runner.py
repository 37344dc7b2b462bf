"""Timed LoRA training steps of one model under one paradigm, with the time broken down where it goes."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType

from ..api import cap_gpu_memory, default_lora_config, prepare
from ..config import MoeccConfig
from ..losses import chunked_causal_lm_loss
from .plan import SEQUENCE
from .rates import synchronize
from .presets import preset_nbytes, random_model

PARADIGMS = ("cocompute", "offload", "gpu", "hf-offload")
_NOT_COMPUTE = ("Memcpy", "Memset")  # profiler names of device events that are copies, not kernels
_PROFILED_STEP_LIMIT_S = 10.0  # longer steps are not profiled again (the profiler slows a step down)


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
    logits tensor (15 GB at 8192 tokens for Qwen3's vocabulary). With ``max_seconds``, fewer steps are timed
    (at least one) when ``steps`` of them would take longer than that. On CUDA, unless ``profile_gpu`` is False,
    one more step (of up to 10 s) runs under the profiler for ``gpu_kernels_s``, the time the GPU spent
    computing (copies excluded): a step close to it, or to the copy time, leaves nothing to hide.
    """
    optimizer = adamw(model.parameters())
    seq = min(tokens, SEQUENCE)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // seq), seq), device=device)
    engine = getattr(getattr(model, "moecc", None), "engine", None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records: list[tuple[float, dict]] = []

    def train_step() -> None:
        chunked_causal_lm_loss(model, ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    retries_before = 0

    for step in range(warmup + steps):
        if step == warmup and device.type == "cuda":
            retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        if records and max_seconds is not None and sum(r[0] for r in records) * (1 + 1 / len(records)) > max_seconds:
            break  # the next step would take the timed ones past max_seconds
        if engine is not None:
            engine.reset_metrics()
        synchronize(device)
        start = time.perf_counter()
        train_step()
        synchronize(device)
        step_s = time.perf_counter() - start
        metrics = engine.metrics_since_reset() if engine is not None else {}
        if step >= warmup:
            records.append((step_s, metrics))
    step_s = statistics.median(r[0] for r in records)
    # cudaMalloc calls that failed and were retried after freeing the allocator's cache (each synchronises the
    # device): a budget cap that the step presses against shows here before it shows as out of memory.
    retries = (torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries_before
               if device.type == "cuda" else 0)

    def median(key: str) -> float:
        return statistics.median(r[1].get(key, 0.0) for r in records)

    cpu_s, copy_s, wait_s = median("cpu_experts_s"), median("copy_s"), median("gpu_wait_s")
    expert_gpu_s = median("expert_compute_s")
    # Disjoint parts of the step for the stacked plot: what the device waited for (the CPU experts under
    # co-compute, expert copies under offload: copies it did not wait for were hidden), the expert math on
    # the device (offload), and the rest (attention, dense layers, head, optimizer, host overhead).
    cpu_wait_s = wait_s if cpu_s > 0 else 0.0
    copy_wait_s = wait_s if cpu_s == 0 else 0.0
    return {
        "step_s": step_s, "tokens_per_s": ids.numel() / step_s, "steps_timed": len(records),
        "tokens_timed": ids.numel(),  # ``tokens`` rounded down to whole sequences of 2048 above that
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        "alloc_retries_per_step": retries / len(records),
        "cpu_experts_s": cpu_s, "pcie_s": copy_s, "gpu_wait_s": wait_s,
        "cpu_wait_s": cpu_wait_s, "copy_wait_s": copy_wait_s, "expert_compute_s": expert_gpu_s,
        "gpu_other_s": max(0.0, step_s - cpu_wait_s - copy_wait_s - expert_gpu_s),
        "h2d_gb": median("h2d_gb"), "d2h_gb": median("d2h_gb"),
        "h2d_gbps_while_copying": median("h2d_gb") / copy_s if copy_s > 0 else 0.0,
        "gpu_kernels_s": (_profiled_kernel_s(train_step, model, device)
                          if profile_gpu and device.type == "cuda" and step_s <= _PROFILED_STEP_LIMIT_S else None),
    }


HF_OFFLOAD_NEEDS_CUDA = ("hf-offload needs a CUDA GPU: accelerate's offload copies the experts from host memory to "
                         "the GPU at each forward, and there is no GPU here")
_EXPECTED_FAILURES = (RuntimeError, ValueError, torch.OutOfMemoryError)


def _check_whole_model_fits(needed_bytes: int, device: torch.device, budget_gb: float | None) -> None:
    """The ``gpu`` paradigm's up-front check: every weight (plus ~10% for LoRA, activations) under the budget."""
    needed_gb = needed_bytes / 1e9
    limit = budget_gb if budget_gb is not None else (
        torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None)
    if limit is not None and needed_gb * 1.1 > limit:
        raise RuntimeError(f"the whole model needs {needed_gb:.1f} GB on the GPU; the budget is {limit:g} GB")


def _whole_model_on_gpu(base: torch.nn.Module, lora, device: torch.device, budget_gb: float | None):
    """The ``gpu`` paradigm: plain PEFT with every weight on the device, if the budget allows it."""
    from peft import get_peft_model

    _check_whole_model_fits(sum(p.nbytes for p in base.parameters()), device, budget_gb)
    cap_gpu_memory(device, budget_gb)
    return get_peft_model(base, lora).to(device)


def _hf_offload(base: torch.nn.Module, lora, device: torch.device, budget_gb: float | None, state: dict):
    """The ``hf-offload`` paradigm under the GPU budget (an allocation past it fails), and why its expert LoRA
    would not train, if it would not. That check runs a step; under ``auto`` checkpointing (``state``) a step
    that runs out of memory is tried again with gradient checkpointing, as for the timed steps."""
    from . import hf_offload

    cap_gpu_memory(device, budget_gb)
    model = hf_offload.build(base, lora, device)
    if state["on"]:  # --checkpointing on: from the first step
        _enable_checkpointing(model)
    return model, _fall_back_to_checkpointing(model, state, lambda: hf_offload.untrained_expert_lora(model, device))


def _build(paradigm: str, base: torch.nn.Module, lora, device: torch.device, budget_gb: float | None,
           state: dict):
    """``(model, caveat)``: the model to time under ``paradigm``, and a reason its numbers mislead, or None."""
    if paradigm == "gpu":
        return _whole_model_on_gpu(base, lora, device, budget_gb), None
    if paradigm == "hf-offload":
        return _hf_offload(base, lora, device, budget_gb, state)
    # MOECC_* variables (threads, backend, prepack_weights ...) apply; the budget is the bench's own.
    config = dataclasses.replace(MoeccConfig.from_env(), gpu_memory_budget_gb=budget_gb)
    return prepare(base, lora_config=lora, paradigm=paradigm, device=device, config=config), None


def _error_message(paradigm: str, error: Exception) -> str:
    text = (str(error).strip().splitlines() or [""])[0][:200]
    if paradigm == "hf-offload":  # errors from inside accelerate / PEFT / transformers: the type says a lot
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text


CHECKPOINTING = ("auto", "on", "off")


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face gradient checkpointing (non-reentrant), as a user short of GPU memory would turn it on."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _free_after_out_of_memory(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fall_back_to_checkpointing(model: torch.nn.Module, state: dict, run):
    """``run()``; under ``auto`` (``state``), once more with gradient checkpointing turned on if it runs out of
    GPU memory, which then stays on for what follows (the larger token counts)."""
    try:
        return run()
    except torch.OutOfMemoryError:
        if state["mode"] != "auto" or state["on"]:
            raise
    # Outside the except block, so the failed step's frames (and their tensors) are gone before the retry.
    _free_after_out_of_memory(model)
    _enable_checkpointing(model)
    state["on"] = True
    return run()


def _dtype(preset: str) -> torch.dtype:
    """The bench models' dtype: bf16, as real checkpoints; float32 for the tiny test preset."""
    return torch.float32 if preset == "tiny" else torch.bfloat16


def build_for_timing(preset: str, layers: int | None, paradigm: str, device: torch.device, budget_gb: float | None,
                     checkpointing: str = "auto", rank: int = 8) -> tuple[torch.nn.Module, str | None, dict]:
    """``(model, caveat, state)``: the bench's random-weight ``preset`` model with LoRA of ``rank`` under
    ``paradigm`` and the budget, a reason its numbers mislead (or None), and the checkpointing state that
    :func:`time_with_checkpointing` takes (``checkpointing``: ``auto``, ``on`` or ``off``)."""
    base = random_model(preset, layers, _dtype(preset))
    lora = default_lora_config(base, rank=rank)
    state = {"mode": checkpointing, "on": checkpointing == "on"}
    model, caveat = _build(paradigm, base, lora, device, budget_gb, state)
    if state["on"]:
        _enable_checkpointing(model)
    return model, caveat, state


def time_with_checkpointing(model: torch.nn.Module, device: torch.device, count: int, steps: int, state: dict,
                            max_seconds: float | None = None, profile_gpu: bool = True):
    """:func:`time_training`, falling back to gradient checkpointing as :func:`_fall_back_to_checkpointing`
    says (``state`` from :func:`build_for_timing`)."""
    return _fall_back_to_checkpointing(
        model, state, lambda: time_training(model, device, count, steps, max_seconds=max_seconds,
                                            profile_gpu=profile_gpu))


def run_case(preset: str, layers: int | None, paradigm: str, tokens: list[int], steps: int, rank: int,
             device: torch.device, budget_gb: float | None, checkpointing: str = "auto",
             max_seconds: float | None = None, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per token count; a paradigm that cannot run gives rows with an ``error`` saying why.

    ``hf-offload`` records whatever the stock route raises; when it runs but its expert LoRA does not train,
    its rows carry the times and that as the ``error``. ``checkpointing``: ``on`` / ``off`` Hugging Face
    gradient checkpointing, or ``auto``: off until a token count runs out of GPU memory, then on (each row
    says which it ran with). ``max_seconds``: time fewer than ``steps`` steps for a token count whose steps
    would take longer than that (see :func:`time_training`). ``on_row`` is called with each timed row as soon
    as it is done.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    if device.type == "cuda" and device.index is None:  # the memory budget is set per numbered device
        device = torch.device("cuda", torch.cuda.current_device())
    if paradigm == "hf-offload" and device.type != "cuda":
        return [{"paradigm": paradigm, "tokens": count, "error": HF_OFFLOAD_NEEDS_CUDA} for count in tokens]
    if device.type == "cuda":  # budgets count from a clean device: no blocks cached by an earlier case
        gc.collect()
        torch.cuda.empty_cache()
    model, rows = None, []
    try:
        if paradigm == "gpu":  # before building: a model that cannot fit is not worth minutes of set-up
            _check_whole_model_fits(preset_nbytes(preset, layers, _dtype(preset)), device, budget_gb)
        model, caveat, state = build_for_timing(preset, layers, paradigm, device, budget_gb, checkpointing, rank)
        for count in tokens:
            timing = time_with_checkpointing(model, device, count, steps, state, max_seconds)
            row = {"paradigm": paradigm, "tokens": count, **timing, "checkpointing": state["on"]}
            if paradigm == "offload":  # where the expert LoRA lives changes the step (see plan.predict)
                row["lora_on_device"] = model.moecc.engine.lora_on_device
            rows.append({**row, "error": caveat} if caveat else row)
            if on_row is not None:
                on_row(rows[-1])
    except Exception as error:
        if paradigm != "hf-offload" and not isinstance(error, _EXPECTED_FAILURES):
            raise
        done = {row["tokens"] for row in rows}
        rows += [{"paradigm": paradigm, "tokens": count, "error": _error_message(paradigm, error)}
                 for count in tokens if count not in done]
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _died(returncode: int) -> str:
    if returncode < 0:
        signal = -returncode
        return f"was killed by signal {signal}" + (" (most likely out of host memory)" if signal == 9 else "")
    return f"exited with status {returncode}"


def run_case_isolated(preset: str, layers: int | None, paradigm: str, tokens: list[int], steps: int, rank: int,
                      device: torch.device, budget_gb: float | None, checkpointing: str = "auto",
                      max_seconds: float | None = None) -> list[dict]:
    """:func:`run_case` in a fresh Python process, so one paradigm's host memory (a 60 GB model, pinned buffers
    PyTorch keeps cached), GPU memory cap and CUDA state cannot slow down or break the next one. Rows finished
    before the process died are kept; the others say how it died."""
    case = dict(preset=preset, layers=layers, paradigm=paradigm, tokens=tokens, steps=steps, rank=rank,
                device=str(device), budget_gb=budget_gb, checkpointing=checkpointing, max_seconds=max_seconds)
    with tempfile.TemporaryDirectory(prefix="moecc-bench-") as folder:
        result = Path(folder) / "rows.jsonl"
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"}  # see moecc/__init__
        process = subprocess.run([sys.executable, "-m", "moecc.bench.runner", json.dumps(case), str(result)],
                                 env=env, check=False)
        rows = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    if process.returncode != 0:
        done = {row["tokens"] for row in rows}
        rows += [{"paradigm": paradigm, "tokens": count,
                  "error": f"the benchmark process {_died(process.returncode)}; its output is above"}
                 for count in tokens if count not in done]
    return rows


def _run_case_main(case_json: str, result_path: str) -> None:
    """Child side of :func:`run_case_isolated`: one JSON line per row, appended as each is done."""
    case = json.loads(case_json)
    case["device"] = torch.device(case["device"])
    with open(result_path, "a") as result:
        def write(row: dict) -> None:
            result.write(json.dumps(row) + "\n")
            result.flush()
        rows = run_case(**case, on_row=write)
        for row in rows:
            if "error" in row and "step_s" not in row:  # rows without timings (on_row saw only timed ones)
                write(row)


if __name__ == "__main__":
    _run_case_main(*sys.argv[1:3])
