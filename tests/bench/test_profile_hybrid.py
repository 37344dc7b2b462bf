"""benchmarks/profile_hybrid.py runs end to end on the CPU and its forced splits put the work where they say."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_hybrid.py"


def test_profile_hybrid_reports_each_split():
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--layers", "2", "--tokens", "64",
                           "--steps", "1", "--rules", "own,all_gpu,all_cpu,own:3", "--rounds", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cases = [re.match(r"round (\d+) +\d+ tokens (\S+) ", line).groups() for line in done.stdout.splitlines()
             if " tokens " in line]
    assert cases == [(r, c) for r in "01" for c in ("own", "all_gpu", "all_cpu", "own:3")]  # interleaved rounds
    lines = {case: line for (_, case), line in zip(cases, (l for l in done.stdout.splitlines() if " tokens " in l))}

    def value(line: str, key: str) -> float:
        return float(re.search(rf"{key} ([0-9.e+-]+)", line).group(1))

    assert value(lines["all_gpu"], "cpu_pairs") == 0 and value(lines["all_gpu"], "gpu_pairs") > 0
    assert value(lines["all_cpu"], "gpu_pairs") == 0 and value(lines["all_cpu"], "cpu_pairs") > 0
