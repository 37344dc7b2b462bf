"""benchmarks/profile_step.py runs end to end (on the CPU here, where every second counts as GPU idle)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py"


def test_profile_step_reports_each_token_count():
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--layers", "2", "--tokens", "32,64",
                           "--paradigm", "offload"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [line for line in done.stdout.splitlines() if line.startswith("profiled step")]
    assert [r.split("(")[1].split(")")[0] for r in reports] == ["offload, 32 tokens", "offload, 64 tokens"]
    assert "neither" in reports[0] and "allocator retries 0" in reports[0]
