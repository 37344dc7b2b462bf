"""Where the threads that queue GPU work spend a training step: running (CPU time) or blocked, and on what.

A paradigm whose host thread is busy for most of the step is launch-bound (a faster GPU or link would not help);
one that blocks is waiting for the device, a copy or the CPU part. Builds the ``moecc bench`` model, runs warm-up
steps, then times ``--steps`` steps: per step the wall time, the CPU time of the forward's thread (the caller's)
and of the backward's (autograd's device thread), and the seconds each spent blocked, by call site, in CUDA
event and stream syncs, ``tolist`` / ``item`` of device tensors, and joins of CPU parts (``Future.result``).
Syncs inside torch ops (a boolean index, ``nonzero``) are counted by call site through torch's sync debug mode.

    python benchmarks/probe_host_waits.py --paradigm hybrid --tokens 512 --out moecc-bench/host_waits
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
import warnings
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import moecc  # noqa: F401  (before torch, as moecc runs it)
import torch

from moecc.bench import runner, timing
from moecc.losses import chunked_causal_lm_loss


class Blocks:
    """Seconds blocked per (thread role, call site), while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.backward_thread: int | None = None
        self.lock = threading.Lock()

    def role(self) -> str:
        ident = threading.get_ident()
        if ident == threading.main_thread().ident:
            return "forward thread"
        if ident == self.backward_thread:
            return "backward thread"
        return threading.current_thread().name

    def add(self, site: str, seconds: float) -> None:
        with self.lock:
            key = (self.role(), site)
            self.seconds[key] += seconds
            self.calls[key] += 1


def call_site(skip: int = 2) -> str:
    """The innermost moecc frame (file:line function) above the wrapper."""
    for frame in reversed(traceback.extract_stack()[:-skip]):
        if "/moecc/" in frame.filename and "probe_host_waits" not in frame.filename:
            return f"{frame.filename.split('/moecc/', 1)[1]}:{frame.lineno} {frame.name}"
    return "outside moecc"


def wrap_blocking(blocks: Blocks) -> None:
    """Times every blocking call the host makes on the device or a CPU part."""

    def timed(owner, name: str, label: str, only=None) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not blocks.on or (only is not None and not only(*args)):
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                blocks.add(f"{label} @ {call_site()}", time.perf_counter() - start)

        setattr(owner, name, wrapper)

    timed(torch.cuda.Event, "synchronize", "event.synchronize")
    timed(torch.cuda.Stream, "synchronize", "stream.synchronize")
    timed(torch.cuda, "synchronize", "cuda.synchronize")
    timed(Future, "result", "future.result")
    timed(torch.Tensor, "tolist", "tolist", only=lambda t: t.is_cuda)
    timed(torch.Tensor, "item", "item", only=lambda t: t.is_cuda)


def thread_cpu_s(ident: int | None) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident)) if ident is not None else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--paradigm", default="hybrid")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpu-budget", type=float, default=24.0)
    parser.add_argument("--out", default="moecc-bench/host_waits")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_host_waits: needs a CUDA device (the host's waits on it are what it measures)")
    device = torch.device("cuda", torch.cuda.current_device())
    model, _, _ = runner.build_for_timing(args.preset, args.layers, args.paradigm, device, args.gpu_budget, "off")
    optimizer = timing.adamw(model.parameters())
    seq = min(args.tokens, timing.SEQUENCE)
    ids = torch.randint(0, model.config.vocab_size, (max(1, args.tokens // seq), seq), device=device)
    blocks = Blocks()
    wrap_blocking(blocks)
    syncs: dict[str, int] = defaultdict(int)

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if blocks.on and "synchroniz" in str(message):
            syncs[f"{blocks.role()} @ {call_site(skip=3)}"] += 1

    warnings.showwarning = on_warning
    warnings.simplefilter("always")

    def mark_backward_thread(grad):
        blocks.backward_thread = threading.get_ident()
        return grad

    rows = []
    for step in range(args.warmup + args.steps):
        timed_step = step >= args.warmup
        blocks.on = timed_step
        if timed_step:
            torch.cuda.set_sync_debug_mode("warn")
        timing.synchronize(device)
        cpu0 = (thread_cpu_s(threading.main_thread().ident), thread_cpu_s(blocks.backward_thread))
        start = time.perf_counter()
        forward_start = start
        loss = chunked_causal_lm_loss(model, ids, ids)
        forward_s = time.perf_counter() - forward_start
        loss.register_hook(mark_backward_thread)
        backward_cpu0 = thread_cpu_s(blocks.backward_thread)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timing.synchronize(device)
        wall = time.perf_counter() - start
        torch.cuda.set_sync_debug_mode(0)
        if timed_step:
            rows.append({"step_s": wall, "forward_call_s": forward_s,
                         "forward_thread_cpu_s": thread_cpu_s(threading.main_thread().ident) - cpu0[0],
                         "backward_thread_cpu_s": thread_cpu_s(blocks.backward_thread) - backward_cpu0})
    steps = len(rows)
    blocked = sorted(((role, site, s / steps, blocks.calls[(role, site)] / steps)
                      for (role, site), s in blocks.seconds.items()), key=lambda r: -r[2])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{args.paradigm}, {args.preset}, {args.layers} layers, {args.tokens} tokens"
    (out / f"host_waits_{args.paradigm}_{args.tokens}.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "title": title, "steps": rows, "blocked": blocked,
         "syncs_in_ops": dict(syncs)}, indent=1))
    lines = [f"# Host threads, {title}", "", f"`python {' '.join(sys.argv)}`", "",
             "| step s | forward call s | forward thread CPU s | backward thread CPU s |", "|---|---|---|---|"]
    lines += [f"| {r['step_s']:.3f} | {r['forward_call_s']:.3f} | {r['forward_thread_cpu_s']:.3f} | "
              f"{r['backward_thread_cpu_s']:.3f} |" for r in rows]
    lines += ["", "Blocked, per step (thread, call site, ms, calls):", "", "| thread | site | ms | calls |",
              "|---|---|---|---|"]
    lines += [f"| {role} | {site} | {s * 1e3:.2f} | {n:.0f} |" for role, site, s, n in blocked[:25]]
    lines += ["", "Syncs inside torch ops, per step (torch's sync debug mode):", ""]
    lines += [f"- {site}: {n / steps:.0f}" for site, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:20]]
    (out / f"host_waits_{args.paradigm}_{args.tokens}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
