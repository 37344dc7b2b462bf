"""benchmarks/profile_hybrid.py runs end to end on the CPU and its forced splits put the work where they say."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_hybrid.py"


def test_profile_hybrid_reports_each_split():
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--layers", "2", "--tokens", "64",
                           "--steps", "1", "--rules", "own,all_gpu,all_cpu"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split()[2]: line for line in done.stdout.splitlines() if " tokens " in line}
    assert set(lines) == {"own", "all_gpu", "all_cpu"}

    def value(line: str, key: str) -> float:
        return float(re.search(rf"{key} ([0-9.e+-]+)", line).group(1))

    assert value(lines["all_gpu"], "cpu_pairs") == 0 and value(lines["all_gpu"], "gpu_pairs") > 0
    assert value(lines["all_cpu"], "gpu_pairs") == 0 and value(lines["all_cpu"], "cpu_pairs") > 0
