"""benchmarks/hybrid_modes_ab.py: settings parsed, interleaved round by round on one model, their variables set only
for their own steps, and each mode run as asked."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from .scripts import BENCHMARKS, load_benchmark


def test_settings_parse_and_bad_ones_are_refused():
    ab = load_benchmark("hybrid_modes_ab")
    assert ab.parse_setting("a=split:X=1,Y=two") == ("a", "split", {"X": "1", "Y": "two"})
    assert ab.parse_setting("b=gpu") == ("b", "gpu", {})
    with pytest.raises(argparse.ArgumentTypeError, match="name=split"):
        ab.parse_setting("c=cpu")


def test_a_settings_variables_hold_during_its_steps_only(monkeypatch):
    ab = load_benchmark("hybrid_modes_ab")
    seen = []

    class Engine:
        step_guard = None

    class Model:
        class moecc:  # noqa: N801  (the attribute the engine hangs off)
            engine = Engine()

    def fake_time_training(model, device, tokens, steps, warmup, profile_gpu):
        seen.append((os.environ.get("MOECC_AB_TEST_VAR"), model.moecc.engine.step_guard.mode))
        return {"steps": []}

    monkeypatch.setattr(ab, "time_training", fake_time_training)
    monkeypatch.delenv("MOECC_AB_TEST_VAR", raising=False)
    state = {"mode": "off", "on": False}
    ab.time_setting(Model(), "cpu", 64, 1, "gpu", {"MOECC_AB_TEST_VAR": "1"}, state)
    assert seen == [("1", "gpu")] and "MOECC_AB_TEST_VAR" not in os.environ


def test_runs_interleaved_on_the_cpu_device(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "hybrid_modes_ab.py"), "--preset", "tiny", "--tokens",
                           "64", "--rounds", "2", "--steps", "1", "--setting", "a=split:MOECC_AB_TEST_VAR=1",
                           "--setting", "b=gpu", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["round"], r["setting"], r["mode"]) for r in rows] == [(0, "a", "split"), (0, "b", "gpu"),
                                                                    (1, "a", "split"), (1, "b", "gpu")]
    assert all(len(r["steps"]) == 1 and r["step_s"] > 0 for r in rows)
    table = (tmp_path / "ab.md").read_text()
    assert "| 64 | a |" in table and "| 64 | b |" in table
