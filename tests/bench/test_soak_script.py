"""benchmarks/soak.py runs each paradigm in its own process, samples its figures and writes the table, the samples
and the plot; its slope and summary arithmetic is checked against hand-made samples."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .scripts import BENCHMARKS, load_benchmark


def test_slope_and_summary_are_least_squares_after_warm_up():
    soak = load_benchmark("soak")
    assert soak.slope([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx(0.2)
    samples = [{"step": s, "rss_mb": 100.0 + (50 if s < 20 else 0.5 * s), "pinned_mb": None, "gpu_allocated_mb": None,
                "gpu_reserved_mb": None, "threads": 7, "open_files": 4} for s in range(0, 100, 10)]
    summary = soak.summarise(samples, warm_up=20)
    assert summary["rss_mb"] == {"first": 110.0, "growth": 35.0, "max_growth": 35.0, "slope_per_step": 0.5}
    assert summary["threads"]["growth"] == 0 and "pinned_mb" not in summary  # unreported figures are left out


def test_soak_script_writes_table_samples_and_plot(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "soak.py"), "--preset", "tiny", "--layers", "1",
                           "--tokens", "32", "--steps", "24", "--warm-up", "4", "--sample-every", "4",
                           "--save-every", "10", "--paradigms", "cocompute,offload", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "soak.json").read_text())
    assert [r["paradigm"] for r in results] == ["cocompute", "offload"]
    for r in results:
        assert r["steps"] == 24 and len(r["samples"]) == 6 and r["finite_losses"]
        assert r["summary"]["open_files"]["first"] > 0
    table = (tmp_path / "soak.md").read_text()
    assert table.count("\n| cocompute |") == 1 and "| offload | 24 |" in table
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_soak_script_rejects_a_warm_up_that_leaves_no_samples():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "soak.py"), "--steps", "50", "--warm-up", "45"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--warm-up 45 leaves fewer than two samples" in done.stderr
