"""The panel kernel alone (no expert routing): FLOP/s on one problem per thread, for each ISA this CPU runs.

Shapes: a task of the co-compute products that stays in L2 (256 tokens x 64 outputs x K=2048) and a
weight-streaming one (16 tokens x 16384 outputs x K=2048: 64 MB of weights per thread, more than the caches
hold, so the few-tokens-per-expert regime, bound by DRAM). Prints a table and writes it as markdown under --out.

    python benchmarks/bench_panel_kernel.py
"""
from __future__ import annotations

import argparse
from pathlib import Path

from moecc import _C, _ops

SHAPES = {"L2-resident 256x64x2048": (256, 64, 2048), "weight-streaming 16x16384x2048": (16, 16384, 2048)}


def rates(isa: str, reps: int) -> dict[str, float]:
    """TFLOP/s per shape: one thread, and summed over the pool's threads (each on its own copy)."""
    row = {}
    for name, (tokens, n, k) in SHAPES.items():
        row[f"{name} 1 thread"] = _C.panel_gemm_flops(_ops.ISAS[isa], tokens, n, k, reps) / 1e12
        row[f"{name} all threads"] = _C.panel_gemm_flops(_ops.ISAS[isa], tokens, n, k, reps, _ops.num_threads()) / 1e12
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/cpu_experts")
    args = parser.parse_args()
    table = []
    for isa in ("portable", "avx512_bf16", "amx"):
        try:
            _ops.check_isa(isa)
        except ValueError:
            continue
        table.append((isa, rates(isa, args.reps)))
        print(table[-1], flush=True)
    columns = list(table[0][1])
    header = (f"`python benchmarks/bench_panel_kernel.py` ({_ops.num_threads()} threads, "
              f"{_ops.cpu_features()['brand'].strip()}); TFLOP/s")
    lines = [header, "",
             "| isa | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    lines += [f"| {isa} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |" for isa, row in table]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "panel_kernel.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
