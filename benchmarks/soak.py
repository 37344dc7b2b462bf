"""Soak: many LoRA training steps of a random-weight preset model per paradigm, with host RSS, pinned host memory,
GPU memory, threads and open files sampled. After warm-up they should stay flat; the table gives each one's
growth and least-squares slope, the plot their course.

Each paradigm runs in a fresh process (one paradigm's caches do not show up in the next one's figures). Every
``--save-every`` steps the adapter is saved (atomically) and every ``--eval-every`` steps a no-grad forward runs,
so leaks in saving, evaluation-style passes and dropped graphs show too.

    python benchmarks/soak.py --preset qwen3-30b-a3b --layers 2 --tokens 512 --steps 1000 --gpu-budget 24 \
        --paradigms cocompute,offload,hybrid --out benchmarks/results/soak
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import moecc  # noqa: E402  (before torch: it sets OMP_WAIT_POLICY, or torch's idle threads spin on its cores)
import torch  # noqa: E402

from moecc.bench.presets import random_model  # noqa: E402
from moecc.bench.shapes import SEQUENCE  # noqa: E402

FIGURES = ("rss_mb", "pinned_mb", "gpu_allocated_mb", "gpu_reserved_mb", "threads", "open_files")


def rss_mb() -> float:
    """This process's resident set, MB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def threads() -> int:
    """This process's threads."""
    return len(os.listdir("/proc/self/task"))


def open_files() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def pinned_mb() -> float | None:
    """Pinned host memory torch's caching host allocator holds, MB (None where torch does not report it)."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return stats().get("allocated_bytes.current", 0) / 2**20
    except RuntimeError:
        return None


def sample(step: int, device: torch.device) -> dict:
    """Every figure of :data:`FIGURES` at ``step``."""
    gc.collect()
    cuda = device.type == "cuda"
    return {
        "step": step, "rss_mb": rss_mb(), "pinned_mb": pinned_mb(),
        "gpu_allocated_mb": torch.cuda.memory_allocated(device) / 2**20 if cuda else None,
        "gpu_reserved_mb": torch.cuda.memory_reserved(device) / 2**20 if cuda else None,
        "threads": threads(), "open_files": open_files(),
    }


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, value)`` points, value per step."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    num = sum((x - mean_x) * (y - mean_y) for x, y in points)
    den = sum((x - mean_x) ** 2 for x, _ in points)
    return num / den if den else 0.0


def summarise(samples: list[dict], warm_up: int) -> dict:
    """Per figure: value at the first sample after warm-up, growth to the last, largest growth, slope per step."""
    after = [s for s in samples if s["step"] >= warm_up]
    out = {}
    for name in FIGURES:
        points = [(s["step"], s[name]) for s in after if s[name] is not None]
        if len(points) < 2:
            continue
        first = points[0][1]
        out[name] = {"first": round(first, 2), "growth": round(points[-1][1] - first, 2),
                     "max_growth": round(max(v for _, v in points) - first, 2),
                     "slope_per_step": round(slope(points), 5)}
    return out


def soak_one(args) -> dict:
    """Trains ``args.paradigm`` for ``args.steps`` steps (or until ``args.max_seconds``), sampling as it goes."""
    from tqdm import tqdm

    from moecc.adapter_files import install_atomic_save
    from moecc.api import default_lora_config
    from moecc.bench.timing import adamw
    from moecc.config import MoeccConfig
    from moecc.losses import chunked_causal_lm_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = random_model(args.preset, args.layers, torch.bfloat16)
    config = dataclasses.replace(MoeccConfig.from_env(), gpu_memory_budget_gb=args.gpu_budget)
    model = moecc.prepare(base, lora_config=default_lora_config(base, rank=args.rank), paradigm=args.paradigm,
                          device=device, config=config)
    install_atomic_save(model)
    optimizer = adamw(model.parameters(), lr=1e-5)
    seq = min(args.tokens, SEQUENCE)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (max(1, args.tokens // seq), seq), generator=generator)
               .to(device) for _ in range(8)]
    samples, losses, start = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for step in tqdm(range(args.steps), desc=args.paradigm, mininterval=10):
            ids = batches[step % len(batches)]
            loss = chunked_causal_lm_loss(model, ids, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % args.eval_every == args.eval_every - 1:
                with torch.no_grad():
                    model(input_ids=ids[:1, :64])
            if step % args.save_every == args.save_every - 1:
                model.save_pretrained(Path(scratch) / "adapter")
            if step % args.sample_every == 0:
                samples.append(sample(step, device))
            if args.max_seconds and time.perf_counter() - start > args.max_seconds:
                break
    steps = len(losses)
    return {"paradigm": args.paradigm, "steps": steps, "seconds": round(time.perf_counter() - start, 1),
            "warm_up": args.warm_up, "summary": summarise(samples, args.warm_up), "samples": samples,
            "python_threads_at_end": threading.active_count(), "first_loss": losses[0], "last_loss": losses[-1],
            "finite_losses": all(v == v and abs(v) != float("inf") for v in losses)}


def _row(result: dict) -> str:
    s = result.get("summary", {})

    def cell(name: str, scale: float = 1.0, unit: str = "") -> str:
        if name not in s:
            return "—"
        f = s[name]
        return f"{f['first']:.0f}{unit} / {f['growth']:+.1f} / {f['slope_per_step'] * scale:+.2f}"

    if "error" in result:
        return f"| {result['paradigm']} | failed: {result['error'][:120]} |" + " |" * 7
    return (f"| {result['paradigm']} | {result['steps']} | {result['seconds']:.0f} | "
            f"{cell('rss_mb', 1024)} | {cell('pinned_mb', 1024)} | {cell('gpu_allocated_mb', 1024)} | "
            f"{cell('gpu_reserved_mb', 1024)} | {cell('threads')} | {cell('open_files')} | "
            f"{result['first_loss']:.3f} → {result['last_loss']:.3f} |")


def write_report(results: list[dict], out: Path, command: str) -> None:
    """``soak.md`` (the table), ``soak.json`` (every sample) and ``soak.png`` (the figures over the steps)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(results, indent=1))
    lines = [f"`{command}`", "",
             "Each memory cell: MB at the first sample after warm-up / growth to the last sample, MB / slope, KB per "
             "step. Threads and open files: count / growth / slope per step.", "",
             "| paradigm | steps | s | host RSS | pinned host | GPU allocated | GPU reserved | threads | open files "
             "| loss |", "|" + "---|" * 10]
    lines += [_row(r) for r in results]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for axis, name in zip(axes.flat, FIGURES):
        for r in results:
            points = [(s["step"], s[name]) for s in r.get("samples", []) if s[name] is not None]
            if points:
                axis.plot(*zip(*points), label=r["paradigm"])
        axis.axvline(results[0].get("warm_up", 0), color="grey", linestyle=":")
        axis.set_title(name)
        axis.set_xlabel("step")
        if axis.get_lines():
            axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warm-up", type=int, default=100, help="steps before the figures count")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--gpu-budget", type=float, default=24.0, help="GB")
    parser.add_argument("--paradigms", default="cocompute,offload,hybrid")
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=None, help="per paradigm; stops early, says so")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    parser.add_argument("--paradigm", help=argparse.SUPPRESS)  # the child process: one paradigm
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("layers", "tokens", "steps", "sample_every", "save_every", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warm_up >= args.steps - args.sample_every:
        parser.error(f"--warm-up {args.warm_up} leaves fewer than two samples of --steps {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.paradigm:
        args.result.write_text(json.dumps(soak_one(args)))
        return 0
    results = []
    for paradigm in args.paradigms.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                     "--paradigm", paradigm, "--result", result.name]
            run = subprocess.run(child)
            text = Path(result.name).read_text()
            results.append(json.loads(text) if run.returncode == 0 and text else
                           {"paradigm": paradigm, "error": f"exit status {run.returncode}"})
    write_report(results, args.out, "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
