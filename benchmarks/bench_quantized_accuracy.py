"""Accuracy of LoRA trained on quantized frozen experts: the demo fine-tune per expert format, and each format's
weight error on a real-shaped preset.

    python benchmarks/bench_quantized_accuracy.py [--steps 300] [--seeds 0,1,2,3,4] [--weight-layers 1]
        [--out benchmarks/results/quantized_experts]

Fine-tune: ``examples/finetune_lora.py --expert-format F`` (its bf16 demo variant, experts held in F; one process
per format and seed) for bf16, fp8, int8, int4 at groups of 32 / 64 / 128 and mxfp4; the held-out loss and answer
accuracy before and after training, each format's median over the seeds and its range. Weight error: the relative
Frobenius norm ``||dequantize(quantize(W)) - W|| / ||W||`` of each format over both projections of the first
``--weight-layers`` layers of the ``qwen3-30b-a3b`` preset's random bf16 weights (``moecc.bench.presets``).
Writes ``accuracy.md``, ``accuracy.json`` and ``accuracy.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_lora.py"
CASES = (("bf16", None), ("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("mxfp4", None))
HELD_OUT = re.compile(r"held-out (before|after):\s+loss ([0-9.]+), answer accuracy ([0-9.]+)%")
WEIGHT_PRESET = "qwen3-30b-a3b"


def fine_tune(expert_format: str, group: int | None, seed: int, steps: int) -> dict:
    """One run of the demo fine-tune: ``{loss_before, accuracy_before, loss_after, accuracy_after}``."""
    with tempfile.TemporaryDirectory(prefix="moecc-accuracy-") as folder:
        command = [sys.executable, str(EXAMPLE), "--expert-format", expert_format, "--seed", str(seed),
                   "--steps", str(steps), "--device", "cpu", "--out", str(Path(folder) / "adapter")]
        if group is not None:
            command += ["--int4-group", str(group)]
        result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=folder)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
    row = {}
    for when, loss, accuracy in HELD_OUT.findall(result.stdout):
        row[f"loss_{when}"], row[f"accuracy_{when}"] = float(loss), float(accuracy) / 100
    return row


def summarize(runs: list[dict]) -> dict:
    """Median, lowest and highest of each measure over the seeds' runs (the median: one seed's training can stall
    in any format, and a mean would charge it to the format)."""
    return {key: {"median": statistics.median(run[key] for run in runs), "min": min(run[key] for run in runs),
                  "max": max(run[key] for run in runs)} for key in runs[0]}


def weight_errors(layers: int) -> list[dict]:
    """Relative Frobenius error and bytes a weight of each format on the preset's first ``layers`` layers."""
    from moecc.bench.presets import random_model
    from moecc.experts.formats import dequantize, quantized_bytes
    from moecc.store import EXPERT_PARAMETERS, convert, expert_chunks, kernel_view

    model = random_model(WEIGHT_PRESET, layers, torch.bfloat16)
    projections = [kernel_view(layer.mlp.experts, getattr(layer.mlp.experts, name).data)
                   for layer in model.model.layers for name in EXPERT_PARAMETERS]
    del model
    rows = []
    for expert_format, group in CASES[1:]:
        error = norm = 0.0
        held = weights = 0
        for w in projections:
            q = convert(w, expert_format, group)
            for part in expert_chunks(tuple(w.shape)):
                values = w[part].float()
                error += (dequantize(q.experts(part)).float() - values).pow(2).sum().item()
                norm += values.pow(2).sum().item()
            held += quantized_bytes(tuple(w.shape), expert_format, group)
            weights += w.numel()
        rows.append({"format": expert_format, "group": group, "relative_error": (error / norm) ** 0.5,
                     "bytes_per_weight": held / weights, "weights": weights})
    return rows


def _label(expert_format: str, group: int | None) -> str:
    return expert_format if group is None else f"{expert_format} g{group}"


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return result.stdout.strip() or "unknown"


def _cpu() -> str:
    from moecc import _ops

    return _ops.cpu_features().get("brand", "").strip() or "unknown CPU"


def _cell(stats: dict, percent: bool) -> str:
    scale, unit = (100, "%") if percent else (1, "")
    return f"{stats['median'] * scale:.{1 if percent else 3}f}{unit} ({stats['min'] * scale:.{1 if percent else 3}f}-" \
           f"{stats['max'] * scale:.{1 if percent else 3}f})"


def write_markdown(result: dict, out: Path) -> None:
    seeds = ", ".join(map(str, result["seeds"]))
    lines = [
        "# Accuracy of LoRA on quantized frozen experts",
        "",
        f"- command: `{result['command']}`",
        f"- commit: {result['commit']}",
        f"- hardware: {result['cpu']}, no GPU (accuracy does not depend on it)",
        f"- date: {result['date']}",
        "",
        f"The demo fine-tune (`examples/finetune_lora.py --expert-format F`: the bf16 variant of the demo model, LoRA "
        f"r=16, {result['steps']} steps of 32 sequences) per format, seeds {seeds}: held-out loss and answer "
        "accuracy before and after training, median over the seeds (lowest-highest). \"Before\" is the random base "
        "model with its experts in the format.",
        "",
        "| format | int4 group | loss before | loss after | accuracy before | accuracy after |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["fine_tune"]:
        s = row["summary"]
        lines.append(f"| {row['format']} | {row['group'] or '-'} | {_cell(s['loss_before'], False)} | "
                     f"{_cell(s['loss_after'], False)} | {_cell(s['accuracy_before'], True)} | "
                     f"{_cell(s['accuracy_after'], True)} |")
    weights = result["weight_error"][0]["weights"] / 1e9
    count = result["weight_layers"]
    layers = "the first layer's" if count == 1 else f"the first {count} layers'"
    lines += [
        "",
        f"## Weight error on the {WEIGHT_PRESET} preset",
        "",
        f"Relative Frobenius error `||dequantize(quantize(W)) - W|| / ||W||` over both projections of {layers} "
        f"128 experts ({weights:.2f} billion weights; the preset's random bf16 "
        "values, N(0, 0.02) tiled from one block, the down projection scaled), and the bytes a weight takes with "
        "its scales (bf16: 2).",
        "",
        "| format | int4 group | relative error | bytes a weight |",
        "|---|---|---|---|",
    ]
    lines += [f"| {row['format']} | {row['group'] or '-'} | {row['relative_error']:.4f} | "
              f"{row['bytes_per_weight']:.3f} |" for row in result["weight_error"]]
    (out / "accuracy.md").write_text("\n".join(lines) + "\n")


def write_plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["fine_tune"]
    labels = [_label(row["format"], row["group"]) for row in rows]
    errors = {(row["format"], row["group"]): row["relative_error"] for row in result["weight_error"]}
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, key, title in ((axes[0], "loss_after", "held-out loss after"),
                             (axes[1], "accuracy_after", "answer accuracy after")):
        stats = [row["summary"][key] for row in rows]
        medians = [s["median"] for s in stats]
        spread = [[m - s["min"] for m, s in zip(medians, stats)], [s["max"] - m for m, s in zip(medians, stats)]]
        axis.bar(labels, medians, yerr=spread, capsize=4, color="tab:blue")
        axis.set_title(f"{title} (median, seed range)")
        axis.tick_params(axis="x", rotation=45)
        low = min(s["min"] for s in stats)
        axis.set_ylim(low * 0.95, max(s["max"] for s in stats) * 1.02)
    quantized = labels[1:]
    axes[2].bar(quantized, [errors[(row["format"], row["group"])] for row in rows[1:]], color="tab:orange")
    axes[2].set_yscale("log")
    axes[2].set_title(f"relative weight error, {WEIGHT_PRESET} (log scale)")
    axes[2].tick_params(axis="x", rotation=45)
    figure.suptitle("LoRA on quantized frozen experts: the demo fine-tune, and the weight error")
    figure.tight_layout()
    figure.savefig(out / "accuracy.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds of the model and the batches")
    parser.add_argument("--weight-layers", type=int, default=1, help="preset layers whose weight error is measured")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantized_experts"))
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = []
    for expert_format, group in CASES:
        runs = []
        for seed in seeds:
            runs.append(fine_tune(expert_format, group, seed, args.steps))
            print(_label(expert_format, group), f"seed {seed}:", runs[-1], flush=True)
        rows.append({"format": expert_format, "group": group, "runs": runs, "summary": summarize(runs)})
    errors = weight_errors(args.weight_layers)
    for row in errors:
        print(_label(row["format"], row["group"]), f"relative error {row['relative_error']:.4f}", flush=True)
    result = {"command": "python benchmarks/bench_quantized_accuracy.py " + " ".join(sys.argv[1:]),
              "commit": _commit(), "cpu": _cpu(), "date": date.today().isoformat(), "steps": args.steps,
              "seeds": seeds, "weight_layers": args.weight_layers, "fine_tune": rows, "weight_error": errors}
    result["command"] = result["command"].strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out)
    write_plot(result, args.out)
    print("wrote", ", ".join(str(args.out / name) for name in ("accuracy.md", "accuracy.json", "accuracy.png")))


if __name__ == "__main__":
    main()
