"""A hybrid training step under the profiler, as lanes a person can look at: the CPU part of each layer (the
native kernels on the worker thread), host-to-device copies, device-to-host copies and GPU kernels.

Builds the ``moecc bench`` model under ``paradigm="hybrid"``, runs warm-up steps (the split's costs settle), then
profiles one step and writes ``timeline.json`` (every interval per lane, ms from the step's start),
``timeline.png`` (the whole step, and one layer's forward and backward zoomed in) and prints, per zoomed layer, how
long each lane was busy and how long the CPU part and the copies were busy together; then, per pass, the medians
over the layers of each CPU part's chain (``chain``: waiting for its inputs, computing, writing its results out,
and the gap from the part of the layer before it in pass order).

    python benchmarks/hybrid_timeline.py --layers 16 --tokens 2048 --out moecc-bench/hybrid_timeline
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

# As `moecc bench` runs hybrid: the GPU waits for the CPU parts on its own only where CUDA loads kernels eagerly
# (moecc/paradigms/device_wait.py); under lazy loading the host waits, and the timeline would show that instead.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import moecc  # noqa: E402,F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from moecc.bench import runner, timing  # noqa: E402
from moecc.losses import chunked_causal_lm_loss  # noqa: E402

LANES = ("CPU experts", "H2D copies", "D2H copies", "GPU kernels")
LAYER_MARKS = {"forward": "moecc.hybrid.layer_forward", "backward": "moecc.hybrid.layer_backward"}


def lane_of(event) -> str | None:
    """The lane a profiler event belongs to, or None for events the timeline leaves out."""
    name = event.name
    if event.device_type == DeviceType.CUDA:
        if getattr(event, "is_user_annotation", False):
            return None
        if name.startswith("Memcpy HtoD"):
            return "H2D copies"
        if name.startswith("Memcpy DtoH"):
            return "D2H copies"
        return None if name.startswith(("Memcpy", "Memset")) else "GPU kernels"
    return None


def host_ops(events, window: tuple[float, float], origin_us: float, top: int = 12) -> list:
    """The outermost host-side ops, and moecc's annotations, within ``window`` (ms after ``origin_us``), by name:
    [name, ms, calls], longest first: where the threads that queue the GPU work spend a layer call."""
    totals: dict[str, list] = {}
    for event in events:
        if event.device_type != DeviceType.CPU or (event.cpu_parent is not None
                                                   and not event.name.startswith("moecc.")):
            continue
        start, end = (event.time_range.start - origin_us) / 1e3, (event.time_range.end - origin_us) / 1e3
        if start >= window[0] and end <= window[1]:
            entry = totals.setdefault(event.name, [event.name, 0.0, 0])
            entry[1] += end - start
            entry[2] += 1
    return [[name, round(ms, 3), calls] for name, ms, calls in sorted(totals.values(), key=lambda e: -e[1])[:top]]


def device_ops(events, window: tuple[float, float], origin_us: float, top: int = 15) -> list:
    """The GPU kernels within ``window`` by name: [name (cut to 90 characters), ms, launches], longest first."""
    totals: dict[str, list] = {}
    for event in events:
        if lane_of(event) != "GPU kernels":
            continue
        start, end = (event.time_range.start - origin_us) / 1e3, (event.time_range.end - origin_us) / 1e3
        if start >= window[0] and end <= window[1]:
            entry = totals.setdefault(event.name[:90], [event.name[:90], 0.0, 0])
            entry[1] += end - start
            entry[2] += 1
    return [[name, round(ms, 3), n] for name, ms, n in sorted(totals.values(), key=lambda e: -e[1])[:top]]


def host_waits(events, window: tuple[float, float], origin_us: float, least_ms: float = 0.2) -> list:
    """Where the threads that queue the GPU work blocked within ``window``: each synchronize call of the CUDA
    runtime at least ``least_ms`` long, as [start ms, ms, its outermost op's name, thread], in time order."""
    out = []
    for event in events:
        if event.device_type != DeviceType.CPU or "Synchronize" not in event.name:
            continue
        start, end = (event.time_range.start - origin_us) / 1e3, (event.time_range.end - origin_us) / 1e3
        if start < window[0] or end > window[1] or end - start < least_ms:
            continue
        outer = event
        while outer.cpu_parent is not None:
            outer = outer.cpu_parent
        out.append([round(start, 3), round(end - start, 3), f"{outer.name} > {event.name}", event.thread])
    return sorted(out)


def cpu_lane(marks: list) -> list[tuple[int, int]]:
    """(start, end) Unix ns of each CPU part's compute, from the engine's ``cpu_part.marks`` (one worker: a layer's
    "started" comes before its "computed")."""
    starts, spans = {}, []
    for phase, index, name, ns in marks:
        if name == "started":
            starts[(phase, index)] = ns
        elif name == "computed":
            spans.append((starts.pop((phase, index)), ns))
    return spans


def collect(events, cpu_spans: list, trace_start_ns: int) -> tuple[dict[str, list], dict[str, list], float]:
    """(lane -> sorted [start, end] in ms, pass -> sorted [start, end] of each layer call, the origin in us) from
    profiler events and the engine's CPU parts (Unix ns: the profiler records the calling thread only, not the
    engine's worker), all relative to the earliest interval."""
    lanes: dict[str, list] = {lane: [] for lane in LANES}
    lanes["CPU experts"] = [[(a - trace_start_ns) / 1e6, (b - trace_start_ns) / 1e6] for a, b in cpu_spans]
    layers: dict[str, list] = {phase: [] for phase in LAYER_MARKS}
    marks = {name: phase for phase, name in LAYER_MARKS.items()}
    for event in events:
        span = [event.time_range.start / 1e3, event.time_range.end / 1e3]
        lane = lane_of(event)
        if lane is not None:
            lanes[lane].append(span)
        elif event.device_type == DeviceType.CPU and event.name in marks:
            layers[marks[event.name]].append(span)
    spans = [s for group in (*lanes.values(), *layers.values()) for s in group]
    origin = min((s[0] for s in spans), default=0.0)
    for group in (*lanes.values(), *layers.values()):
        group[:] = sorted([a - origin, b - origin] for a, b in group)
    return lanes, layers, origin * 1e3


def merged(spans: list) -> list:
    """Overlapping intervals joined."""
    out: list = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def busy_ms(spans: list, window: tuple[float, float]) -> float:
    """Milliseconds of ``window`` covered by ``spans``."""
    return sum(max(0.0, min(b, window[1]) - max(a, window[0])) for a, b in merged(spans))


def together_ms(first: list, second: list, window: tuple[float, float]) -> float:
    """Milliseconds of ``window`` in which both lanes were busy."""
    total, b = 0.0, merged(second)
    for a0, a1 in merged(first):
        total += sum(max(0.0, min(a1, y, window[1]) - max(a0, x, window[0])) for x, y in b)
    return total


def layer_window(layers: dict[str, list], phase: str) -> tuple[float, float] | None:
    """A middle layer call of ``phase``: from its start to the next layer call's start (its whole share of a
    sequential pass), or None where the pass had fewer than two layer calls."""
    calls = layers[phase]
    if len(calls) < 2:
        return None
    middle = len(calls) // 2 - 1
    return calls[middle][0], calls[middle + 1][0]


def summary(lanes: dict[str, list], window: tuple[float, float]) -> dict[str, float]:
    """Per lane busy ms in ``window``, and the ms in which the CPU part and the H2D copies ran together."""
    out = {"window_ms": window[1] - window[0]}
    out.update({lane: busy_ms(spans, window) for lane, spans in lanes.items()})
    out["CPU experts and H2D copies together"] = together_ms(lanes["CPU experts"], lanes["H2D copies"], window)
    return {key: round(value, 3) for key, value in out.items()}


CHAIN_STEPS = {"inputs_wait_ms": ("submitted", "started"), "compute_ms": ("started", "computed"),
               "results_out_ms": ("computed", "done")}


def chain(marks: list) -> dict[str, dict[str, float]]:
    """Per pass, medians over the layers (ms) of each CPU part's steps (``CHAIN_STEPS``: submitted to the worker,
    inputs on the host, computed, results written and published) and of the chain from one layer's part to the
    next layer's in pass order (forward: up, backward: down), which waits for the first's results on the device:
    ``host_gap_ms`` (the part done to the next one submitted) and ``chain_gap_ms`` (to the next one's inputs on the
    host), with ``cycle_ms`` (one part's start to the next's)."""
    times: dict[tuple[str, int], dict[str, int]] = {}
    for phase, index, name, ns in marks:
        times.setdefault((phase, index), {})[name] = ns  # the last of a layer's parts in the step
    out = {}
    for phase, step in (("forward", 1), ("backward", -1)):
        rows: dict[str, list[float]] = {}
        for (p, index), t in times.items():
            if p != phase:
                continue
            for key, (a, b) in CHAIN_STEPS.items():
                if a in t and b in t:
                    rows.setdefault(key, []).append((t[b] - t[a]) / 1e6)
            before = times.get((phase, index - step), {})
            if "done" in before and "submitted" in t and "started" in t:
                rows.setdefault("host_gap_ms", []).append((t["submitted"] - before["done"]) / 1e6)
                rows.setdefault("chain_gap_ms", []).append((t["started"] - before["done"]) / 1e6)
                rows.setdefault("cycle_ms", []).append((t["started"] - before["started"]) / 1e6)
        if rows:
            out[phase] = {key: round(statistics.median(v), 3) for key, v in rows.items()}
            out[phase]["parts"] = len(rows.get("compute_ms", []))
    return out


def plot(lanes: dict[str, list], windows: dict[str, tuple[float, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("whole step", None)] + [(f"one layer, {phase}", w) for phase, w in windows.items()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.2 * len(panels)), squeeze=False)
    colors = dict(zip(LANES, ("tab:orange", "tab:blue", "tab:purple", "tab:green")))
    for ax, (label, window) in zip(axes[:, 0], panels):
        for row, lane in enumerate(LANES):
            bars = [(a, b - a) for a, b in merged(lanes[lane])]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[lane])
        ax.set_yticks(range(len(LANES)), LANES)
        ax.invert_yaxis()
        if window is not None:
            ax.set_xlim(*window)
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlabel("ms from the step's start")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    parser.add_argument("--gpu-budget", type=float, default=24.0)
    parser.add_argument("--out", default="moecc-bench/hybrid_timeline")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, _, _ = runner.build_for_timing(args.preset, args.layers, "hybrid", device, args.gpu_budget, "off")
    model.moecc.engine.split.guard = None  # every step with the planner's splits: the timeline shows both sides
    optimizer = timing.adamw(model.parameters())
    seq = min(args.tokens, timing.SEQUENCE)
    ids = torch.randint(0, model.config.vocab_size, (max(1, args.tokens // seq), seq), device=device)

    def step() -> None:
        chunked_causal_lm_loss(model, ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timing.synchronize(device)

    for _ in range(args.warmup):
        step()
    engine = model.moecc.engine
    engine.cpu_part.marks = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    events = prof.events()
    marks, engine.cpu_part.marks = engine.cpu_part.marks, None
    lanes, layers, origin_us = collect(events, cpu_lane(marks), prof.profiler.kineto_results.trace_start_ns())
    windows = {phase: w for phase in LAYER_MARKS if (w := layer_window(layers, phase)) is not None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (f"python benchmarks/hybrid_timeline.py --preset {args.preset} --layers {args.layers} --tokens "
               f"{args.tokens} --warmup {args.warmup} --gpu-budget {args.gpu_budget}")
    report = {"command": command, "device": str(device), "lanes": lanes, "layer_calls": layers,
              "zoomed": {phase: {"window": list(w), **summary(lanes, w)} for phase, w in windows.items()},
              "host_ops": {phase: host_ops(events, w, origin_us) for phase, w in windows.items()},
              "device_ops": {phase: device_ops(events, w, origin_us) for phase, w in windows.items()},
              "host_waits": {phase: host_waits(events, w, origin_us) for phase, w in windows.items()},
              "chain": chain(marks)}
    (out / "timeline.json").write_text(json.dumps(report))
    plot(lanes, windows, out / "timeline.png", f"hybrid, {args.preset}, {args.layers} layers, {args.tokens} tokens")
    for phase, numbers in report["zoomed"].items():
        print(json.dumps({"pass": phase, **numbers}), flush=True)
        for key in ("host_ops", "device_ops", "host_waits"):
            print(json.dumps({"pass": phase, key: report[key][phase]}), flush=True)
    for phase, numbers in report["chain"].items():
        print(json.dumps({"pass": phase, "chain": numbers}), flush=True)
    print(f"wrote {out / 'timeline.json'} and {out / 'timeline.png'}")


if __name__ == "__main__":
    main()
