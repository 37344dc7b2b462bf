"""Where one CPU-experts call spends its time beyond the kernel phases: a diagnosis aid for the CPU kernels.

For each token count it runs the native forward and backward of one Qwen3-30B-A3B-shaped layer a few times, then
reports per pass: wall time; the kernel phases (``_C.last_phase_times``) and their sum; the PyTorch ops around
the kernels (from the profiler: conversions, copies, checks) and their sum; what is left (the C++ call outside
its phases, Python); and minor page faults (pages touched for the first time).

    python benchmarks/profile_cpu_experts.py --tokens 256,8192
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import moecc  # noqa: F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
from torch.profiler import ProfilerActivity, profile

from bench_cpu_experts import SHAPES, make_case  # noqa: E402  (run from benchmarks/ or with it on sys.path)
from moecc import _C, _ops
from moecc.experts.native import NativeExperts


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _pass_report(name: str, fn, backward: bool) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        faults, start = _faults(), time.perf_counter()
        result = fn()
        wall = time.perf_counter() - start  # inside: the profiler's own start and stop are not the call's
        faults = _faults() - faults
    phases = dict(_C.last_phase_times(backward))
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages() if e.key.startswith("aten::")}
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
    row = {"pass": name, "wall_ms": wall * 1e3, "phases_ms": sum(phases.values()) * 1e3,
           "torch_ops_ms": sum(ops.values()) * 1e3, "page_faults": faults}
    row["rest_ms"] = row["wall_ms"] - row["phases_ms"] - row["torch_ops_ms"]
    row["top_torch_ops_ms"] = {k: round(v * 1e3, 2) for k, v in top}
    return row, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="256,8192")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the report as markdown here")
    args = parser.parse_args()
    native = NativeExperts(_ops.best_isa())
    lines = [f"`python benchmarks/profile_cpu_experts.py --shape {args.shape} --tokens {args.tokens}` "
             f"({native.isa}, {_ops.num_threads()} threads)", "",
             "| tokens | pass | wall_ms | phases_ms | torch_ops_ms | rest_ms | page_faults | top torch ops (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens in (int(t) for t in args.tokens.split(",")):
        weights, gate_up, down, x, index, w, grad = make_case(args.shape, tokens, "uniform", args.rank)
        lora = (gate_up, down)
        for _ in range(args.warmup):  # results handed back as co-compute does: the profiled passes reuse them
            out, saved = native.forward(weights, x, index, w, *lora)
            native.release_result(out)
            native.release_result(native.backward(weights, saved, grad, *lora)[0])
        forward, (_, saved) = _pass_report("forward", lambda: native.forward(weights, x, index, w, *lora), False)
        backward, _ = _pass_report("backward", lambda: native.backward(weights, saved, grad, *lora), True)
        for row in (forward, backward):
            print({"tokens": tokens, **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}})
            lines.append(f"| {tokens} | {row['pass']} | {row['wall_ms']:.1f} | {row['phases_ms']:.1f} | "
                         f"{row['torch_ops_ms']:.1f} | {row['rest_ms']:.1f} | {row['page_faults']} | "
                         f"{row['top_torch_ops_ms']} |")
    if args.out:
        path = Path(args.out) / f"profile_cpu_experts_{native.isa}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
