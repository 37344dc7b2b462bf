"""Timed LoRA training steps of one model under one paradigm, with the time broken down where it goes."""
from __future__ import annotations

import gc
import statistics
import time

import torch

from ..api import default_lora_config, prepare
from ..config import MoeccConfig
from .presets import random_model

PARADIGMS = ("cocompute", "offload", "gpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training(model: torch.nn.Module, device: torch.device, tokens: int, steps: int,
                  warmup: int = 1) -> dict:
    """Median step time and its breakdown over ``steps`` optimizer steps of ``tokens`` tokens each."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    seq = min(tokens, 2048)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // seq), seq), device=device)
    engine = getattr(getattr(model, "moecc", None), "engine", None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records = []
    for step in range(warmup + steps):
        if engine is not None:
            engine.reset_metrics()
        _sync(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_s = time.perf_counter() - start
        metrics = engine.metrics_since_reset() if engine is not None else {}
        if step >= warmup:
            records.append((step_s, metrics))
    step_s = statistics.median(r[0] for r in records)
    median = lambda key: statistics.median(r[1].get(key, 0.0) for r in records)  # noqa: E731
    cpu_s, copy_s, wait_s = median("cpu_experts_s"), median("copy_s"), median("gpu_wait_s")
    return {
        "step_s": step_s, "tokens_per_s": ids.numel() / step_s,
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
        "cpu_experts_s": cpu_s, "pcie_s": copy_s, "gpu_wait_s": wait_s,
        "gpu_other_s": max(0.0, step_s - cpu_s - copy_s),  # the three parts add up to the step
        "h2d_gb": median("h2d_gb"), "d2h_gb": median("d2h_gb"),
    }


def run_case(preset: str, layers: int | None, paradigm: str, tokens: list[int], steps: int, rank: int,
             device: torch.device, budget_gb: float | None) -> list[dict]:
    """One row per token count; a paradigm that cannot run gives rows with an ``error`` saying why."""
    dtype = torch.float32 if preset == "tiny" else torch.bfloat16
    base = random_model(preset, layers, dtype)
    lora = default_lora_config(base, rank=rank)
    rows = []
    try:
        if paradigm == "gpu":
            from peft import get_peft_model

            needed_gb = sum(p.nbytes for p in base.parameters()) / 1e9
            limit = budget_gb if budget_gb is not None else (
                torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None)
            if limit is not None and needed_gb * 1.1 > limit:
                raise RuntimeError(f"the whole model needs {needed_gb:.1f} GB on the GPU; the budget is {limit:g} GB")
            model = get_peft_model(base, lora).to(device)
        else:
            config = MoeccConfig(gpu_memory_budget_gb=budget_gb)
            model = prepare(base, lora_config=lora, paradigm=paradigm, device=device, config=config)
        for count in tokens:
            rows.append({"paradigm": paradigm, "tokens": count, **time_training(model, device, count, steps)})
    except (RuntimeError, ValueError, torch.OutOfMemoryError) as error:
        done = {row["tokens"] for row in rows}
        rows += [{"paradigm": paradigm, "tokens": count, "error": str(error).splitlines()[0][:200]}
                 for count in tokens if count not in done]
    finally:
        del base
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
