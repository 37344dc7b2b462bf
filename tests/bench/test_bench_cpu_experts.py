"""benchmarks/bench_cpu_experts.py end to end on one small case: its table, and the per-CPU peaks it reports."""
from __future__ import annotations

import json
import subprocess
import sys

from .scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "bench_cpu_experts.py"


def test_bench_writes_its_table_with_the_command_and_each_cpus_peak(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "qwen3-30b-a3b", "--tokens", "256", "--routing",
                           "zipf", "--reps", "1", "--no-baseline", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = next(tmp_path.glob("cpu_experts_*.md")).read_text()
    assert ("`python benchmarks/bench_cpu_experts.py --shapes qwen3-30b-a3b --tokens 256 --isa auto --routing zipf "
            "--reps 1 --no-baseline`") in table
    rows = json.loads(next(tmp_path.glob("cpu_experts_*.json")).read_text())
    assert [(r["tokens"], r["routing"]) for r in rows] == [(256, "zipf")]
    assert rows[0]["forward_ms"] > 0 and rows[0]["backward_ms"] > 0
    assert 0 < rows[0]["best_ms"] <= rows[0]["forward_ms"] + rows[0]["backward_ms"]  # best reps vs medians
    assert "| best_ms |" in table
    # thread time of each product phase, by part: every phase packs weights and runs its products
    parts = rows[0]["forward_product_parts_thread_ms"] | rows[0]["backward_product_parts_thread_ms"]
    assert sorted(parts) == ["down", "down_input_grad", "gate_up", "gate_up_input_grad"]
    assert all(p["pack"] > 0 and p["gemm"] > 0 and p["epilogue"] >= 0 for p in parts.values())
    assert "Host state before / after the cases: memory copy " in table
    if rows[0]["isa"] != "portable":  # the matrix unit's peak, CPU by CPU
        assert "peak per CPU (each alone): min " in table


def test_cpu_peaks_line_names_the_slow_cpus():
    module = load_benchmark("bench_cpu_experts")
    line = module.describe_cpu_peaks("amx", {0: 2.2e12, 1: 2.1e12, 6: 0.96e12, 7: 2.2e12})
    assert "min 0.96 TFLOP/s (CPU 6)" in line and "median 2.15" in line
    assert line.endswith("below 0.8 of the median: CPU 6 (0.96).")
    assert module.describe_cpu_peaks("amx", {0: 2.0e12, 1: 1.9e12}).endswith("below 0.8 of the median: none.")


def test_host_state_line_pairs_before_and_after():
    module = load_benchmark("bench_cpu_experts")
    before = {"copy": 80e9, "amx_core": 2.2e12, "amx_all": 20e12, "avx512_fma_all": 2.5e12}
    after = {"copy": 54e9, "amx_core": 1.0e12, "amx_all": 13.5e12, "avx512_fma_all": 1.6e12}
    assert module.describe_host_state(before, after) == (
        "Host state before / after the cases: memory copy 80 / 54 GB/s; amx_all 20.00 / 13.50 TFLOP/s; "
        "avx512_fma_all 2.50 / 1.60 TFLOP/s.")
    assert module.copy_bandwidth(1 << 20, 2) > 1e8  # a 1 MiB copy moves more than 100 MB/s anywhere
