"""Hybrid's step modes side by side in one process: the planner's splits under each setting asked for, and every
routed expert on the GPU (offload's step, in the same engine), interleaved step by step on one built model.

A shared machine's speed can drift by tens of percent within minutes, so alternatives timed in separate
processes (each building and pinning a 60 GB model first) can land in different states of it. Here one model is
built per run, and each round times every setting in turn; the table gives per setting the median of its steps,
their range, and the median of each round's ratio to the first setting. Settings are ``name=mode`` or
``name=mode:VAR=value,VAR=value`` (``mode`` ``split`` or ``gpu``); the variables are set for that setting's steps
(an engine that reads them at call time sees them); ``cache=off`` among them runs the setting without the expert
cache the model was built with (``MOECC_OFFLOAD_CACHE_GB``), so cache and none interleave too. The step guard is
replaced by the fixed mode.

    python benchmarks/hybrid_modes_ab.py --tokens 512,2048 --rounds 3 \\
        --setting split=split --setting gpu=gpu --out moecc-bench/hybrid_modes_ab
    MOECC_OFFLOAD_CACHE_GB=auto python benchmarks/hybrid_modes_ab.py --tokens 512,8192 --setting split=split \\
        --setting split-none=split:cache=off --setting gpu=gpu --setting gpu-none=gpu:cache=off
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # as moecc bench runs hybrid (device_wait.py)

import moecc  # noqa: E402,F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from moecc.bench import runner  # noqa: E402
from moecc.bench.timing import time_training  # noqa: E402
from moecc.paradigms.step_guard import GPU, SPLIT  # noqa: E402

KEYS = ("step_s", "cpu_experts_s", "pcie_s", "h2d_gb", "h2d_gbps_while_copying", "cpu_wait_s", "copy_wait_s",
        "moved_experts", "gpu_only_steps")


class FixedMode:
    """A step guard that always answers one mode."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def step_begins(self, tokens: int, mark: object, training: bool) -> str:
        return self.mode

    def summary(self) -> dict[int, str]:
        return {}


def parse_setting(text: str) -> tuple[str, str, dict[str, str]]:
    """``name=mode[:VAR=value,...]`` as (name, mode, variables)."""
    name, _, rest = text.partition("=")
    mode, _, assignments = rest.partition(":")
    if not name or mode not in (SPLIT, GPU):
        raise argparse.ArgumentTypeError(f"a setting is name=split|gpu[:VAR=value,...], got {text!r}")
    variables = dict(item.split("=", 1) for item in assignments.split(",") if item)
    return name, mode, variables


def use_cache(engine, on: bool) -> None:
    """Turns the engine's expert cache (built with ``MOECC_OFFLOAD_CACHE_GB``) off, emptied so its memory is free,
    or back on as built; its next pass refills it. Neither state's passes feed the auto cache's peaks."""
    slots = engine.slots
    if not hasattr(engine, "ab_cache"):
        engine.ab_cache = (slots.cache, slots.cache_sizer, slots.cache.budget_bytes if slots.cache is not None else 0)
    cache, sizer, budget = engine.ab_cache
    if cache is None:
        if not on:
            raise ValueError("cache=off asks for a model built with an expert cache: set MOECC_OFFLOAD_CACHE_GB "
                             "(a number of GB, or auto)")
        return
    if not on:
        cache.resize(0)
    elif slots.cache is None:
        cache.resize(budget)
    slots.cache, slots.cache_sizer = (cache, sizer) if on else (None, None)
    slots._cache_pass = None  # a peak spanning the other state's steps would mislead the sizing


def time_setting(model, device, tokens: int, steps: int, mode: str, variables: dict[str, str],
                 state: dict) -> dict:
    """One setting's steps (one untimed first) with its variables set and its mode fixed; ``cache=off`` among the
    variables runs them without the expert cache."""
    variables = dict(variables)
    cache = variables.pop("cache", "on")
    if cache not in ("on", "off"):
        raise ValueError(f"a setting's cache is on or off, got {cache!r}")
    model.moecc.engine.split.guard = FixedMode(mode)  # the planned policy's step guard, fixed
    use_cache(model.moecc.engine, cache == "on")
    with mock.patch.dict(os.environ, variables):
        return runner._fall_back_to_checkpointing(
            model, state, lambda: time_training(model, device, tokens, steps, warmup=1, profile_gpu=False))


def table(rows: list[dict], names: list[str]) -> str:
    """Per token count and setting: the median step, its range, and the median per-round ratio to the first; then
    the settings that failed, with their errors."""
    lines = ["| tokens | setting | step s [range] | / first (rounds' median) | CPU experts s | PCIe s | H2D GB |"
             " GB/s copying | device waited CPU / copies s |", "|---" * 9 + "|"]
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for tokens in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == tokens]
        first = {r["round"]: r["step_s"] for r in at if r["setting"] == names[0]}
        for name in names:
            mine = [r for r in at if r["setting"] == name]
            if not mine:
                continue
            steps = [s["step_s"] for r in mine for s in r["steps"]]
            ratios = [r["step_s"] / first[r["round"]] for r in mine if r["round"] in first]

            def med(key: str) -> float:
                return statistics.median(r[key] for r in mine)
            lines.append(f"| {tokens} | {name} | {statistics.median(steps):.3f} [{min(steps):.3f}-{max(steps):.3f}]"
                         f" | {statistics.median(ratios):.3f} | {med('cpu_experts_s'):.2f} | {med('pcie_s'):.2f} |"
                         f" {med('h2d_gb'):.1f} | {med('h2d_gbps_while_copying'):.1f} |"
                         f" {med('cpu_wait_s'):.2f} / {med('copy_wait_s'):.2f} |")
    lines += [f"\n{r['tokens']} tokens, round {r['round']}, {r['setting']} failed: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def write(out: Path, settings: list, rows: list[dict]) -> None:
    """The rows so far, as `ab.json` under `out` (a run cut short keeps what it timed)."""
    (out / "ab.json").write_text(json.dumps({"settings": [list(s) for s in settings], "rows": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", default="2048")
    parser.add_argument("--setting", action="append", type=parse_setting, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting and round")
    parser.add_argument("--gpu-budget", type=float, default=24.0)
    parser.add_argument("--out", default="moecc-bench/hybrid_modes_ab")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [name for name, _, _ in args.setting]
    started = time.perf_counter()
    model, _, state = runner.build_for_timing(args.preset, args.layers, "hybrid", device, args.gpu_budget)
    print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
    rows: list[dict] = []
    counts = [int(t) for t in args.tokens.split(",")]
    with tqdm(total=len(counts) * args.rounds * len(names), desc="settings timed") as bar:
        for tokens in counts:
            try:
                for round_ in range(args.rounds):
                    for name, mode, variables in args.setting:
                        where = {"tokens": tokens, "round": round_, "setting": name, "mode": mode,
                                 "variables": variables}
                        timing = time_setting(model, device, tokens, args.steps, mode, variables, state)
                        rows.append({**where, "checkpointing": state["on"], **{k: timing.get(k, 0.0) for k in KEYS},
                                     "steps": timing["steps"]})
                        write(out, args.setting, rows)
                        bar.update()
            except runner.EXPECTED_FAILURES as error:  # out of GPU memory at this size: the next size still runs
                rows.append({**where, "error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"})
                write(out, args.setting, rows)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            (out / "ab.md").write_text(table(rows, names))
            print(table([r for r in rows if r["tokens"] == tokens], names), flush=True)


if __name__ == "__main__":
    main()
