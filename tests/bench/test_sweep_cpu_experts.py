"""benchmarks/sweep_cpu_experts.py: its setting syntax, and one small interleaved sweep end to end."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "sweep_cpu_experts.py"


def test_settings_parse_into_knob_values():
    parse = load_benchmark("sweep_cpu_experts").parse_setting
    assert parse("wide:task=16,256,1024,0") == ("wide", {"task": [16, 256, 1024, 0]})
    assert parse("l1:pack=16,0/next=0") == ("l1", {"pack": [16, 0], "next": [0]})
    assert parse("plain:copies=0/outputs=3") == ("plain", {"copies": [0], "outputs": [3]})
    for bad, message in (("nocolon", "expected NAME"), ("x:speed=1", "unknown knob"), ("x:copies=1,2", "1 values"),
                         ("x:pack=8", "2 values"), ("x:next=1,1", "1 values"), ("x:outputs=1,2", "1 values"),
                         ("x:fetch=16", "unknown knob"), ("x:amx=0,64,0,1024", "unknown knob"),
                         ("x:task=a,b,c,d", "integers"), (":copies=1", "expected NAME")):
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_sweep_times_every_setting_and_writes_its_table(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "16,32", "--reps", "2", "--setting",
                           "narrow:task=2,32,64,16/copies=0/outputs=3/pack=16,0/next=0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = next(tmp_path.glob("cpu_experts_sweep_*.md")).read_text().splitlines()
    rows = [line.split(" | ") for line in table if line.startswith("| default") or line.startswith("| narrow")]
    assert [(r[0], r[1]) for r in rows] == [("| default", "16"), ("| default", "32"), ("| narrow", "16"),
                                            ("| narrow", "32")]
    assert all(float(r[4]) > 0 for r in rows)  # best forward + backward, ms
    assert rows[0][-1] == "1.000 |"  # the defaults' score against themselves
    # every knob's built-in value in the header
    assert "default = task [16, 256, 1024, 0], copies 1, outputs 13, pack [8, 1], next 1)" in table[0]


def test_a_setting_out_of_range_is_refused_before_timing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "16", "--reps", "1", "--setting",
                           "bad:outputs=16", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "streaming_outputs" in done.stderr
