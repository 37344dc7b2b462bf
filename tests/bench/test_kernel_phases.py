"""benchmarks/kernel_phases.py prints one JSON line of pass and phase times (its own process: the kernels' pool)."""
from __future__ import annotations

import json
import subprocess
import sys

from .scripts import BENCHMARKS


def test_kernel_phases_prints_every_phase_of_both_passes():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_phases.py"), "--shape", "8,64,32,2",
                           "--tokens", "32", "--reps", "2", "--tag", "t"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["tag"] == "t" and row["tokens"] == 32
    assert row["fwd"] > 0 and row["bwd"] > 0
    forward = [k for k in row if k.startswith("f:")]
    backward = [k for k in row if k.startswith("b:")]
    assert "f:gate_up" in forward and "b:gate_up_input_grad" in backward
    assert all(row[k] >= 0 for k in forward + backward)
    assert sum(row[k] for k in forward) <= row["fwd"] * 1.05 + 0.5  # phases lie inside their pass


def test_kernel_phases_names_a_bad_shape():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_phases.py"), "--shape", "big"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--shape 'big'" in done.stderr
