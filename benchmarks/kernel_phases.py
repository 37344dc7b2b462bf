"""Per-phase times of one layer's native forward and backward (``_C.last_phase_times``), medians over reps.

One JSON line per run, so two builds can be compared phase by phase, alternating fresh processes from each tree:
a change in one kernel shows in its phase alone, a host-wide slowdown in all of them alike.

    python benchmarks/kernel_phases.py --tokens 8192 --reps 3 --tag HEAD
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import moecc  # noqa: F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)

import bench_cpu_experts  # noqa: E402  (run from benchmarks/ or with it on sys.path)
from moecc import _C, _ops
from moecc.experts.native import NativeExperts


def phase_times(shape: str, tokens: int, reps: int, routing: str = "zipf", rank: int = 8,
                warmup: int = 2) -> dict[str, float]:
    """ms per pass (``fwd``, ``bwd``) and per phase (``f:<phase>``, ``b:<phase>``), medians of ``reps``."""
    native = NativeExperts(_ops.best_isa())
    weights, gate_up, down, x, index, w, grad = bench_cpu_experts.make_case(shape, tokens, routing, rank)
    samples = []
    for rep in range(warmup + reps):
        start = time.perf_counter()
        out, saved = native.forward(weights, x, index, w, gate_up, down)
        forward = time.perf_counter() - start
        phases = {f"f:{k}": v for k, v in _C.last_phase_times(False)}
        native.release_result(out)
        start = time.perf_counter()
        grads = native.backward(weights, saved, grad, gate_up, down)
        backward = time.perf_counter() - start
        phases.update({f"b:{k}": v for k, v in _C.last_phase_times(True)})
        native.release_result(grads[0])
        if rep >= warmup:
            samples.append({"fwd": forward, "bwd": backward, **phases})
    return {k: round(statistics.median(s[k] for s in samples) * 1e3, 2) for k in samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b",
                        help=f"one of {sorted(bench_cpu_experts.SHAPES)}, or experts,hidden,intermediate,top_k "
                             "(as bench_cpu_subset.py takes it)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--routing", default="zipf", choices=["uniform", "zipf"])
    parser.add_argument("--tag", default="", help="a label for the line (the build)")
    args = parser.parse_args()
    if args.shape not in bench_cpu_experts.SHAPES:
        try:
            experts, hidden, inter, top_k = (int(v) for v in args.shape.split(","))
        except ValueError:
            parser.error(f"--shape {args.shape!r}: a name of {sorted(bench_cpu_experts.SHAPES)} or four integers")
        bench_cpu_experts.SHAPES[args.shape] = (experts, top_k, hidden, inter)  # make_case's order
    row = phase_times(args.shape, args.tokens, args.reps, args.routing)
    print(json.dumps({"tag": args.tag, "tokens": args.tokens, "isa": _ops.best_isa(),
                      "threads": _ops.num_threads(), **row}))


if __name__ == "__main__":
    main()
