"""benchmarks/bench_cpu_subset.py runs end to end and times the subsets it names (its own process: it sets the
kernels' thread pool)."""
from __future__ import annotations

import re
import subprocess
import sys

from .scripts import BENCHMARKS


def test_bench_cpu_subset_times_each_subset_and_the_whole_layer():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu_subset.py"), "--tokens", "16,64",
                           "--experts", "1,3,8", "--shape", "8,64,32,2", "--reps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"tokens (\d+) experts (\d+) pairs (\d+): forward ([0-9.]+) ms, backward ([0-9.]+) ms",
                      done.stdout)
    assert len(rows) == 6, done.stdout
    for tokens in (16, 64):
        pairs = {int(m): int(p) for t, m, p, _, _ in rows if int(t) == tokens}
        assert pairs[8] == tokens * 2  # every expert: every routed pair
        assert 0 <= pairs[1] <= pairs[3] <= pairs[8]  # the coldest first
    assert all(float(f) > 0 and float(b) > 0 for *_, f, b in rows)
