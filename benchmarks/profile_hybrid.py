"""Where a hybrid step's time goes, by split: the engine's own split against forced ones, on one model.

Builds the ``moecc bench`` model under ``paradigm="hybrid"`` and times training steps (forward, backward and
optimizer separately) with the engine's own split and with the split forced all on the GPU, all on the CPU and
with the coldest experts of each layer on the CPU; prints one line per case with the step's parts, each side's
experts and pairs, the CPU and copy seconds, the waits, the prefetch hit rate and the fitted CPU costs.

    python benchmarks/profile_hybrid.py --layers 16 --tokens 512,2048,8192
    python benchmarks/profile_hybrid.py --layers 16 --tokens 512,2048 --rules own:2,own:3 --rounds 3 --warmup 3 --fresh

``NAME:N`` sets the engine's slots at run time, past the budget check ``prepare`` makes (4 slots ran out of memory
under 24 GB at 8192 tokens); ``NAME:N:n`` also turns the CPU probes off (``CostTracker.probe_after``: the cost fit
then never comes back once it priced the CPU out), ``NAME:N:t`` queues the expert copies through torch instead of
the CUDA driver (``moecc.paradigms.driver_copies``), ``NAME:N:g`` lets the step guard run whole steps with every
expert on the GPU where those were faster (``moecc.paradigms.step_guard``; off otherwise, so each case runs its
rule), ``NAME:N:w`` times whole steps as ``moecc bench`` does (no synchronisation between forward and backward);
``--rounds`` interleaves the cases, since a machine's speed can drift between runs. Each line also gives the seconds spent inside the
native kernel calls per pass (``kernel_forward_s``, ``kernel_backward_s``), which the CPU parts' seconds exceed by
their Python work around the call.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import threading
import time

# As `moecc bench` runs hybrid: the GPU waits for the CPU parts on its own only where CUDA loads kernels eagerly
# (moecc/paradigms/device_wait.py); under lazy loading the host waits instead.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import moecc  # noqa: E402,F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
import torch  # noqa: E402

from moecc import _ops  # noqa: E402
from moecc.bench import runner, timing  # noqa: E402
from moecc.losses import chunked_causal_lm_loss  # noqa: E402
from moecc.paradigms.hybrid import new_trackers  # noqa: E402

KEYS = ("cpu_experts_s", "kernel_forward_s", "kernel_backward_s", "copy_s", "cpu_wait_s", "gpu_wait_s",
        "cpu_experts", "gpu_experts", "cpu_pairs", "gpu_pairs", "moved_experts", "both_sides_share",
        "prefetch_hit_rate", "device_wait_share", "backward_device_wait_share", "cold_cpu_parts", "gpu_only_steps",
        "h2d_gb")


def coldest_on_cpu(count: int):
    """A split rule: each layer's ``count`` least-routed experts on the CPU, the rest on the GPU."""
    return lambda layer, counts, phase: sorted(range(len(counts)), key=lambda e: -counts[e])[:len(counts) - count]


RULES = {"own": None, "all_gpu": lambda layer, counts, phase: range(len(counts)),
         "all_cpu": lambda layer, counts, phase: (), "coldest32_cpu": coldest_on_cpu(32)}


class KernelClock:
    """Seconds inside the native expert kernels by pass, summed over every thread that calls them: around the call
    (``seconds``), in the kernel's own phases (``phases``: what ``_C.last_phase_times`` reports right after the
    call) and in the backend's methods around it (``backend``), with the calls counted."""

    BACKEND = {"forward": ("forward", "forward_pairs"),
               "backward": ("backward", "backward_pairs", "backward_pairs_into", "keep_experts")}

    def __init__(self, backend=None) -> None:
        self._lock = threading.Lock()
        self.reset()
        for phase in self.seconds:
            name = f"expert_ffn_{phase}"
            setattr(_ops._C, name, self._timed(phase, getattr(_ops._C, name), kernel=True))
            for method in self.BACKEND[phase] if backend is not None else ():
                if hasattr(backend, method):
                    setattr(backend, method, self._timed(phase, getattr(backend, method), kernel=False))

    def _timed(self, phase: str, function, kernel: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                with self._lock:
                    if kernel:
                        self.seconds[phase] += seconds
                        self.calls[phase] += 1
                        for name, value in _ops._C.last_phase_times(phase == "backward"):
                            self.phases[phase][name] = self.phases[phase].get(name, 0.0) + value
                    else:
                        self.backend[phase] += seconds
        return timed

    def reset(self) -> None:
        with self._lock:  # a kernel call on another thread may be adding its seconds
            self.seconds = {"forward": 0.0, "backward": 0.0}
            self.backend = dict.fromkeys(self.seconds, 0.0)
            self.calls = dict.fromkeys(self.seconds, 0)
            self.phases = {phase: {} for phase in self.seconds}

    def anatomy(self) -> str:
        """Per pass: calls, ms per call in the backend's methods, around the kernel call, inside its phases, and
        the phases' ms per call."""
        lines = []
        for phase in self.seconds:
            calls = max(1, self.calls[phase])
            inside = sum(self.phases[phase].values())
            lines.append(f"  {phase}: {self.calls[phase]} kernel calls, ms per call: backend "
                         f"{1e3 * self.backend[phase] / calls:.2f}, kernel call {1e3 * self.seconds[phase] / calls:.2f}"
                         f", phases {1e3 * inside / calls:.2f} (" + ", ".join(
                             f"{name} {1e3 * value / calls:.2f}" for name, value in self.phases[phase].items()) + ")")
        return "\n".join(lines)


def time_case(model, optimizer, ids, device, steps: int, warmup: int = 1, host_profile: int = 0,
              clock: KernelClock | None = None, whole: bool = False) -> tuple[list[float], dict]:
    """Median (forward, backward, optimizer) seconds over ``steps`` steps after ``warmup`` steps, and the last
    step's engine metrics. ``host_profile``: one more step under cProfile (the host thread that queues the GPU
    work), whose ``host_profile`` costliest functions by own time, and moecc's by total time, are printed.
    ``whole``: no synchronisation between forward and backward, as ``moecc bench`` times a step (the forward's
    part is then only the host's time to reach the loss)."""
    engine = model.moecc.engine
    parts, metrics = [], {}
    for step in range(steps + warmup + (1 if host_profile else 0)):
        profiler = cProfile.Profile() if step == steps + warmup else None
        if profiler is not None:
            profiler.enable()
        engine.reset_metrics()
        if clock is not None:
            clock.reset()
        timing.synchronize(device)
        marks = [time.perf_counter()]
        loss = chunked_causal_lm_loss(model, ids, ids)
        if not whole:
            timing.synchronize(device)
        marks.append(time.perf_counter())
        loss.backward()
        timing.synchronize(device)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timing.synchronize(device)
        marks.append(time.perf_counter())
        if profiler is not None:
            profiler.disable()
            for order, only in (("tottime", ()), ("cumulative", ("/moecc/",))):  # all by own time; moecc's by total
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*only, host_profile)
                print(f"host profile by {order}:", *(line for line in text.getvalue().splitlines()[-host_profile - 2:]
                                                    if line.strip()), sep="\n")
            break
        metrics = engine.counters_since_reset()  # CUDA's names on any device, as the columns say
        if clock is not None:
            metrics.update({f"kernel_{phase}_s": seconds for phase, seconds in clock.seconds.items()})
        if step >= warmup:
            parts.append([b - a for a, b in zip(marks, marks[1:])])
    return [statistics.median(p[i] for p in parts) for i in range(3)], metrics


def describe(tokens: int, rule: str, parts: list[float], metrics: dict, engine) -> str:
    forward, backward = engine.trackers["forward"], engine.trackers["backward"]
    shown = ", ".join(f"{key} {metrics.get(key, 0.0):.3g}" for key in KEYS)
    return (f"{tokens:>6} tokens {rule:<14} step {1e3 * sum(parts):7.1f} ms (forward {1e3 * parts[0]:.1f}, backward "
            f"{1e3 * parts[1]:.1f}, optimizer {1e3 * parts[2]:.1f}); {shown}; CPU fit forward "
            f"{1e3 * forward.cpu_fixed_s:.1f} ms + {forward.cpu_scale:.2f}x, backward {1e3 * backward.cpu_fixed_s:.1f}"
            f" ms + {backward.cpu_scale:.2f}x; copies {forward.copy_scale:.2f}x; serial forward "
            f"{1e3 * (forward.serial_s or 0):.1f} ms, backward {1e3 * (backward.serial_s or 0):.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpu-budget", type=float, default=24.0)
    parser.add_argument("--rules", default=",".join(RULES),
                        help=f"comma-separated, of {', '.join(RULES)}; NAME:N runs it with N device slots (layers of "
                             "experts: the copies run N - 1 layers ahead)")
    parser.add_argument("--rounds", type=int, default=1, help="the rules again, interleaved (host drift)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each case's")
    parser.add_argument("--fresh", action="store_true", help="each case starts from the first costs again")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="one more step per case under cProfile: its N costliest functions on the host thread")
    parser.add_argument("--samples", metavar="FILE", help="writes each case's CPU fit and its recent samples "
                        "(first-cost and measured seconds per CPU part) as JSON")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model, _, _ = runner.build_for_timing(args.preset, args.layers, "hybrid", device, args.gpu_budget, "off")
    optimizer = timing.adamw(model.parameters())
    engine = model.moecc.engine
    capacity, driver, guard = engine.capacity, engine.driver_copies, engine.step_guard
    fits, clock = [], KernelClock(engine.cpu)
    for round_ in range(args.rounds):
        for tokens in (int(t) for t in args.tokens.split(",")):
            seq = min(tokens, 2048)
            ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // seq), seq), device=device)
            for case in args.rules.split(","):
                rule, _, rest = case.partition(":")  # rule:slots[:options], slots: device slots (layers of experts)
                slots, _, options = rest.partition(":")
                engine.capacity = int(slots) if slots else capacity
                engine.split_rule = RULES.get(rule)
                engine.driver_copies = None if "t" in options else driver  # t: copies through torch
                engine.step_guard = guard if "g" in options else None  # g: the step guard on
                if args.fresh:
                    engine.trackers = new_trackers(engine)
                    engine._cpu_seen.clear()
                for tracker in engine.trackers.values():
                    tracker.probe_after = 0 if "n" in options else len(engine.layers)  # n: no CPU probes
                parts, metrics = time_case(model, optimizer, ids, device, args.steps, args.warmup, args.host_profile,
                                           clock, whole="w" in options)  # w: timed as the bench times a step
                print(f"round {round_} " + describe(tokens, case, parts, metrics, engine), flush=True)
                print(clock.anatomy(), flush=True)
                if args.samples:
                    fits.append({"round": round_, "tokens": tokens, "case": case, "step_s": sum(parts), **{
                        phase: {"fixed_s": t.cpu_fixed_s, "scale": t.cpu_scale, "recent": list(t.recent)}
                        for phase, t in engine.trackers.items()}})
                    with open(args.samples, "w") as f:
                        json.dump(fits, f)
            engine.split_rule = None


if __name__ == "__main__":
    main()
