"""benchmarks/bench_cpu_subset.py runs end to end and times the subsets it names (its own process: it sets the
kernels' thread pool)."""
from __future__ import annotations

import re
import subprocess
import sys

from .scripts import BENCHMARKS


def test_bench_cpu_subset_times_each_subset_and_the_whole_layer():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu_subset.py"), "--tokens", "16,64",
                           "--experts", "1,3,8", "--shape", "8,64,32,2", "--reps", "1", "--loads", "alone,host"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"tokens (\d+) experts (\d+) pairs (\d+) (\w+): forward ([0-9.]+) ms \(([0-9.]+) in the "
                      r"kernel's phases\), backward ([0-9.]+) ms \(([0-9.]+)\) \[(into|pairs)\]", done.stdout)
    assert len(rows) == 12, done.stdout
    assert {row[3] for row in rows} == {"alone", "host"}  # the host load runs on the CPU device without CUDA
    for tokens in (16, 64):
        pairs = {int(m): int(p) for t, m, p, *_ in rows if int(t) == tokens}
        assert pairs[8] == tokens * 2  # every expert: every routed pair
        assert 0 <= pairs[1] <= pairs[3] <= pairs[8]  # the coldest first
    for tokens, experts, pairs, _, *_, path in rows:  # hybrid's path: rows into its buffers where rows pay
        assert path == ("into" if int(experts) < 8 and int(pairs) <= 2 * int(tokens) else "pairs")
    for *_, forward, forward_in, backward, backward_in, _ in rows:
        assert 0 <= float(forward_in) <= float(forward) and 0 <= float(backward_in) <= float(backward)


def test_bench_cpu_subset_phases_name_each_phase_and_the_products_parts():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu_subset.py"), "--tokens", "64", "--experts",
                           "3", "--shape", "8,64,32,2", "--reps", "1", "--phases"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {m.group(1): dict((name, float(ms)) for name, ms in re.findall(r"([\w:]+) ([0-9.]+)", m.group(2)))
             for m in re.finditer(r"^    (forward|backward) ms: (.*)$", done.stdout, re.MULTILINE)}
    assert set(lines) == {"forward", "backward"}, done.stdout
    forward, backward = lines["forward"], lines["backward"]
    assert {"relayout", "gather", "gate_up", "activate", "down", "sum_slots"} <= set(forward)
    assert {"relayout", "down_input_grad", "gate_up_input_grad", "lora_grads", "sum_slots"} <= set(backward)
    for product in ("gate_up", "down"):  # each product phase's parts: thread-ms, each part at least zero
        assert all(forward[f"{product}:{part}"] >= 0 for part in ("pack", "gemm", "epilogue"))
    total = re.search(r"forward [0-9.]+ ms \(([0-9.]+) in the kernel's phases\)", done.stdout)
    phases = sum(ms for name, ms in forward.items() if ":" not in name)
    assert abs(phases - float(total.group(1))) <= 0.05 + 0.02 * phases  # the phases are what the total sums
