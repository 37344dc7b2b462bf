"""Train a real-shaped random MoE whose bf16 experts would not fit in host memory, with quantized experts.

    python benchmarks/bench_quantized_capacity.py [--preset qwen3-30b-a3b] [--layers N] [--expert-format int4]
        [--int4-group 128] [--tokens 128] [--steps 3] [--rank 8] [--out benchmarks/results/quantized_experts]

The preset's model is built straight into ``--expert-format`` (``moecc.bench.presets.random_model``: one projection
of bf16 values at a time, never the whole model's), prepared for co-compute and trained ``--steps`` AdamW steps of
``--tokens`` tokens, none of them untimed. Reports the experts' bf16 and held bytes, host RSS after building and
after ``prepare`` (VmRSS), peak host RSS (VmHWM of this process, from /proc), each step's seconds and the host's
memory; writes ``capacity.md`` and ``capacity.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import moecc  # before torch: torch's OpenMP threads then sleep between ops (moecc/__init__.py)
import torch

from moecc.bench.presets import PRESETS, preset_nbytes, random_model
from moecc.bench.timing import time_training
from moecc.config import EXPERT_FORMATS, INT4_GROUP_SIZES, MoeccConfig


def proc_gb(field: str, path: str = "/proc/self/status") -> float:
    """A ``kB`` field of a /proc file (``VmHWM``, ``VmRSS`` of this process; ``MemTotal`` of /proc/meminfo) in GB."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def expert_bf16_bytes(preset: str, layers: int | None) -> int:
    """Bytes of the routed experts' weights in bf16, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    from moecc.bench.presets import preset_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset, layers), dtype=torch.bfloat16)
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)


def measure(args: argparse.Namespace) -> dict:
    config = dataclasses.replace(MoeccConfig.from_env(), expert_format=args.expert_format,
                                 int4_group_size=args.int4_group)
    start = time.perf_counter()
    base = random_model(args.preset, args.layers, torch.bfloat16, expert_format=config.expert_format,
                        int4_group_size=config.int4_group_size)
    build_s, rss_built = time.perf_counter() - start, proc_gb("VmRSS")
    model = moecc.prepare(base, lora_config=moecc.default_lora_config(base, rank=args.rank), paradigm="cocompute",
                          device=args.device, config=config)
    rss_prepared = proc_gb("VmRSS")
    device = model.moecc.device
    row = time_training(model, device, args.tokens, args.steps, warmup=0, profile_gpu=False)
    trainable, _ = model.get_nb_trainable_parameters()
    return dict(
        preset=args.preset, layers=model.config.num_hidden_layers, expert_format=model.moecc.expert_format,
        int4_group_size=config.int4_group_size if config.expert_format == "int4" else None, rank=args.rank,
        tokens=row["tokens_timed"], steps=row["steps_timed"], device=str(device),
        expert_bf16_gb=expert_bf16_bytes(args.preset, args.layers) / 1e9,
        expert_held_gb=model.moecc.expert_bytes / 1e9,
        model_bf16_gb=preset_nbytes(args.preset, args.layers) / 1e9, trainable_parameters=trainable,
        build_s=build_s, host_rss_after_build_gb=rss_built, host_rss_after_prepare_gb=rss_prepared,
        peak_host_rss_gb=proc_gb("VmHWM"), host_memory_gb=proc_gb("MemTotal", "/proc/meminfo"),
        step_s=row["step_s"], steps_s=[step["step_s"] for step in row["steps"]],
        tokens_per_s=row["tokens_per_s"], cpu_experts_s=row["cpu_experts_s"], peak_gpu_gb=row["peak_gpu_gb"],
        threads=moecc._ops.num_threads(), os_cpus=os.cpu_count(),
        load_average_15_min=os.getloadavg()[2],  # other processes' share of the CPUs while the steps ran
    )


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return result.stdout.strip() or "unknown"


def _cpu() -> str:
    return moecc._ops.cpu_features().get("brand", "").strip() or platform.processor()


def write_report(result: dict, command: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result = {"commit": _commit(), **result, "command": command, "cpu": _cpu(), "date": date.today().isoformat()}
    (out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    form = result["expert_format"] + (f" (groups of {result['int4_group_size']})" if result["int4_group_size"] else "")
    gpu = f"; peak GPU memory {result['peak_gpu_gb']:.1f} GB" if result["device"].startswith("cuda") else ""
    lines = [
        f"# Capacity: {result['preset']}, {result['layers']} layers, {form} experts, co-compute",
        "",
        f"- command: `{command}`",
        f"- commit: {result['commit']}",
        f"- hardware: {result['cpu']}, {result['threads']} threads, {result['host_memory_gb']:.1f} GB RAM, "
        f"{'no GPU' if result['device'] == 'cpu' else result['device']}",
        f"- date: {result['date']}",
        "",
        f"Random weights built straight into {result['expert_format']}; LoRA r={result['rank']} on attention and "
        f"experts ({result['trainable_parameters']:,} trainable parameters, fused AdamW), {result['tokens']} tokens "
        f"a step, {result['steps']} steps, none untimed. The experts take {result['expert_bf16_gb']:.1f} GB in bf16 "
        f"(the whole model {result['model_bf16_gb']:.1f} GB); held in {result['expert_format']} with their scales, "
        f"{result['expert_held_gb']:.1f} GB.",
        "",
        "| host RSS after build GB | after prepare GB | peak host RSS (VmHWM) GB | host memory GB | s/step (median) "
        "| each step s | routed experts s/step | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
        f"| {result['host_rss_after_build_gb']:.1f} | {result['host_rss_after_prepare_gb']:.1f} | "
        f"{result['peak_host_rss_gb']:.1f} | {result['host_memory_gb']:.1f} | {result['step_s']:.1f} | "
        f"{' / '.join(f'{s:.1f}' for s in result['steps_s'])} | {result['cpu_experts_s']:.1f} | "
        f"{result['tokens_per_s']:.2f} |",
        "",
        f"Routed experts: the CPU kernels' forward and backward on the {result['expert_format']} copy; the rest of "
        f"the step is attention, routers, the LM head, the loss and the optimizer on {result['device']}.",
        "",
        f"Building took {result['build_s']:.0f} s{gpu}; the host's 15-minute load average was "
        f"{result['load_average_15_min']:.1f} on {result['os_cpus']} CPUs at the end"
        + (": other processes shared the CPUs, so the steps are slower than on an idle host."
           if result["load_average_15_min"] > result["os_cpus"] + 0.5 else "."),
    ]
    (out / "capacity.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    parser.add_argument("--expert-format", default="int4", choices=[f for f in EXPERT_FORMATS if f != "auto"])
    parser.add_argument("--int4-group", type=int, default=MoeccConfig().int4_group_size, choices=INT4_GROUP_SIZES)
    parser.add_argument("--tokens", type=int, default=128, help="tokens a step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", default=None, help="attention & co.: default cuda if available, else cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantized_experts"))
    args = parser.parse_args()
    command = "python benchmarks/bench_quantized_capacity.py " + " ".join(sys.argv[1:])
    commit = _commit()  # of the code this process runs, before the minutes it takes
    result = measure(args)
    print(json.dumps(result, indent=2))
    write_report({**result, "commit": commit}, command.strip(), args.out)
    print("wrote", args.out / "capacity.md", args.out / "capacity.json")


if __name__ == "__main__":
    main()
