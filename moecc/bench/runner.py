"""Timed LoRA training steps of one model under one paradigm, with the time broken down where it goes."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..api import cap_gpu_memory, default_lora_config, prepare
from ..config import MoeccConfig
from .presets import preset_nbytes, random_model
from .timing import time_training

PARADIGMS = ("cocompute", "offload", "hybrid", "gpu", "hf-offload")
HF_OFFLOAD_NEEDS_CUDA = ("hf-offload needs a CUDA GPU: accelerate's offload copies the experts from host memory to "
                         "the GPU at each forward, and there is no GPU here")
EXPECTED_FAILURES = (RuntimeError, ValueError, torch.OutOfMemoryError)


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


def _dtype(preset: str, expert_format: str = "auto") -> torch.dtype:
    """The bench models' dtype: bf16, as real checkpoints; float32 for the tiny test preset unless an expert format
    is asked for (every format but ``auto`` is made from bf16)."""
    return torch.float32 if preset == "tiny" and expert_format == "auto" else torch.bfloat16


def build_for_timing(preset: str, layers: int | None, paradigm: str, device: torch.device, budget_gb: float | None,
                     checkpointing: str = "auto", rank: int = 8) -> tuple[torch.nn.Module, str | None, dict]:
    """``(model, caveat, state)``: the bench's random-weight ``preset`` model with LoRA of ``rank`` under
    ``paradigm`` and the budget, a reason its numbers mislead (or None), and the checkpointing state that
    :func:`time_with_checkpointing` takes (``checkpointing``: ``auto``, ``on`` or ``off``)."""
    # MOECC_EXPERT_FORMAT builds the routed experts straight into a quantized format, never all of them in bf16
    config = MoeccConfig.from_env()
    base = random_model(preset, layers, _dtype(preset, config.expert_format), expert_format=config.expert_format,
                        int4_group_size=config.int4_group_size)
    lora = default_lora_config(base, rank=rank)
    state = {"mode": checkpointing, "on": checkpointing == "on"}
    model, caveat = _build(paradigm, base, lora, device, budget_gb, state)
    if state["on"]:
        _enable_checkpointing(model)
    return model, caveat, state


def time_with_checkpointing(model: torch.nn.Module, device: torch.device, count: int, steps: int, state: dict,
                            max_seconds: float | None = None, profile_gpu: bool = True, warmup: int = 1):
    """:func:`time_training`, falling back to gradient checkpointing as :func:`_fall_back_to_checkpointing`
    says (``state`` from :func:`build_for_timing`)."""
    return _fall_back_to_checkpointing(
        model, state, lambda: time_training(model, device, count, steps, warmup=warmup, max_seconds=max_seconds,
                                            profile_gpu=profile_gpu))


def run_case(preset: str, layers: int | None, paradigm: str, tokens: list[int], steps: int, rank: int,
             device: torch.device, budget_gb: float | None, checkpointing: str = "auto",
             max_seconds: float | None = None, on_row: Callable[[dict], None] | None = None,
             warmup: int = 1) -> list[dict]:
    """One row per token count; a paradigm that cannot run gives rows with an ``error`` saying why.

    ``hf-offload`` records whatever the stock route raises; when it runs but its expert LoRA does not train,
    its rows carry the times and that as the ``error``. ``checkpointing``: ``on`` / ``off`` Hugging Face
    gradient checkpointing, or ``auto``: off until a token count runs out of GPU memory, then on (each row
    says which it ran with). ``max_seconds``: time fewer than ``steps`` steps for a token count whose steps
    would take longer than that (see :func:`time_training`). ``on_row`` is called with each timed row as soon
    as it is done. ``warmup``: untimed steps before each token count's.
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
            timing = time_with_checkpointing(model, device, count, steps, state, max_seconds, warmup=warmup)
            row = {"paradigm": paradigm, "tokens": count, **timing, "checkpointing": state["on"]}
            if paradigm == "offload":  # where the expert LoRA lives changes the step (see plan.predict)
                row["lora_on_device"] = model.moecc.engine.slots.lora_on_device
            rows.append({**row, "error": caveat} if caveat else row)
            if on_row is not None:
                on_row(rows[-1])
    except Exception as error:
        if paradigm != "hf-offload" and not isinstance(error, EXPECTED_FAILURES):
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
                      max_seconds: float | None = None, warmup: int = 1) -> list[dict]:
    """:func:`run_case` in a fresh Python process, so one paradigm's host memory (a 60 GB model, pinned buffers
    PyTorch keeps cached), GPU memory cap and CUDA state cannot slow down or break the next one. Rows finished
    before the process died are kept; the others say how it died."""
    case = dict(preset=preset, layers=layers, paradigm=paradigm, tokens=tokens, steps=steps, rank=rank,
                device=str(device), budget_gb=budget_gb, checkpointing=checkpointing, max_seconds=max_seconds,
                warmup=warmup)
    with tempfile.TemporaryDirectory(prefix="moecc-bench-") as folder:
        result = Path(folder) / "rows.jsonl"
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"}  # see moecc/__init__
        if paradigm in ("hybrid", "auto"):  # the GPU waits for the CPU parts itself only then (device_wait.py)
            env["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING") or "EAGER"
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
