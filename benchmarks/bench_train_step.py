"""Time full LoRA training steps of a real-shaped MoE (random weights) with moecc's co-compute paradigm.

Builds the model from the preset's real config with ``--layers`` decoder layers, applies LoRA (rank ``--rank``
on attention and experts), and runs warm-up + timed optimizer steps on ``--tokens`` tokens per step. Prints one
line per step and a summary table; writes it as markdown and JSON under ``--out``.

    python benchmarks/bench_train_step.py --preset qwen3-30b-a3b --layers 4 --tokens 2048
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import moecc
from moecc.bench.presets import PRESETS, random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch × sequence)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="moecc-bench")
    args = parser.parse_args()

    start = time.perf_counter()
    model = random_model(args.preset, args.layers, torch.bfloat16)
    build_s = time.perf_counter() - start
    lora = moecc.default_lora_config(model, rank=args.rank)
    model = moecc.prepare(model, lora_config=lora, paradigm="cocompute")
    device = model.moecc.device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = max(1, args.tokens // args.seq)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.tokens // batch), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    rows = []
    for step in range(args.warmup + args.steps):
        model.moecc.engine.metrics.reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        metrics = model.moecc.engine.metrics
        row = dict(step=step, warmup=step < args.warmup, step_s=step_s, loss=loss.item(),
                   cpu_forward_s=metrics.cpu_forward_s, cpu_backward_s=metrics.cpu_backward_s)
        rows.append(row)
        print(json.dumps(row), flush=True)

    timed = [r for r in rows if not r["warmup"]]
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    summary = dict(
        preset=args.preset, layers=args.layers, tokens=args.tokens, rank=args.rank, device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        threads=model.moecc.config.num_threads or torch.get_num_threads(), backend=model.moecc.config.backend,
        build_s=build_s, step_s=statistics.median(r["step_s"] for r in timed),
        cpu_forward_s=statistics.median(r["cpu_forward_s"] for r in timed),
        cpu_backward_s=statistics.median(r["cpu_backward_s"] for r in timed),
        peak_gpu_gb=peak_gb, expert_host_gb=model.moecc.expert_bytes / 1e9,
    )
    summary["tokens_per_s"] = args.tokens / summary["step_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"train_step_{args.preset}_L{args.layers}_T{args.tokens}"
    (out / f"{name}.json").write_text(json.dumps(dict(summary=summary, steps=rows), indent=2))
    table = "| " + " | ".join(summary) + " |\n|" + "---|" * len(summary) + "\n| " + " | ".join(
        f"{v:.3f}" if isinstance(v, float) else str(v) for v in summary.values()) + " |\n"
    (out / f"{name}.md").write_text(f"`python benchmarks/bench_train_step.py --preset {args.preset} "
                                    f"--layers {args.layers} --tokens {args.tokens}`\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
