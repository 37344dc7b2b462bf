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
        class split:  # noqa: N801  (the policy whose step guard a setting fixes)
            guard = None

        class slots:  # noqa: N801
            cache = cache_sizer = None

    class Model:
        class moecc:  # noqa: N801  (the attribute the engine hangs off)
            engine = Engine()

    def fake_time_training(model, device, tokens, steps, warmup, profile_gpu):
        seen.append((os.environ.get("MOECC_AB_TEST_VAR"), model.moecc.engine.split.guard.mode))
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


def test_a_token_count_that_fails_is_recorded_and_the_next_one_still_runs(tmp_path, monkeypatch):
    """Out of GPU memory at one size (activations beside a cache): that size's error is a row and a line under the
    table, and the sizes after it are timed."""
    ab = load_benchmark("hybrid_modes_ab")

    def fake_time_setting(model, device, tokens, steps, mode, variables, state):
        if tokens == 128:
            raise RuntimeError("CUDA out of memory. Tried to allocate 192.00 MiB\nmore")
        return {"step_s": 1.0, "steps": [{"step_s": 1.0}]}

    monkeypatch.setattr(ab, "time_setting", fake_time_setting)
    monkeypatch.setattr(ab.runner, "build_for_timing", lambda *args: (None, None, {"on": False}))
    monkeypatch.setattr(sys, "argv", ["hybrid_modes_ab.py", "--preset", "tiny", "--tokens", "64,128,256",
                                      "--rounds", "2", "--setting", "a=split", "--setting", "b=gpu",
                                      "--out", str(tmp_path)])
    ab.main()
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["tokens"], "error" in r) for r in rows] == [(64, False)] * 4 + [(128, True)] + [(256, False)] * 4
    assert rows[4]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 192.00 MiB"
    table = (tmp_path / "ab.md").read_text()
    assert "| 64 | a |" in table and "| 256 | b |" in table and "| 128 |" not in table
    assert "128 tokens, round 0, a failed: RuntimeError: CUDA out of memory" in table


def test_cache_off_runs_a_setting_without_the_cache_and_on_restores_it(monkeypatch):
    """``cache=off`` empties and detaches the expert cache for its steps only; the next setting gets it back as
    built, and neither state's passes feed the auto cache's peaks."""
    import torch

    from moecc.bench import runner

    ab = load_benchmark("hybrid_modes_ab")
    monkeypatch.setenv("MOECC_OFFLOAD_CACHE_GB", "1")
    model, _, state = runner.build_for_timing("tiny", None, "hybrid", torch.device("cpu"), None)
    engine = model.moecc.engine
    cache = engine.slots.cache
    seen = []

    def fake_time_training(model, device, tokens, steps, warmup, profile_gpu):
        span = engine.slots._cache_pass
        ids = torch.randint(0, 100, (1, tokens))
        for _ in range(2):  # a pass counts the routing, the next one's start refills whatever cache is on
            model(input_ids=ids, labels=ids).loss.backward()
        seen.append((engine.slots.cache is cache, cache.bytes > 0, span))
        return {"steps": []}

    monkeypatch.setattr(ab, "time_training", fake_time_training)
    for variables in ({}, {"cache": "off"}, {}):
        engine.slots._cache_pass = (32, 1, 0)  # a span the other state's steps would have extended
        ab.time_setting(model, "cpu", 32, 1, "split", variables, state)
    assert seen == [(True, True, None), (False, False, None), (True, True, None)]
    with pytest.raises(ValueError, match="cache is on or off, got 'maybe'"):
        ab.time_setting(model, "cpu", 32, 1, "split", {"cache": "maybe"}, state)


def test_cache_off_restores_the_auto_sizer_and_needs_a_cache(monkeypatch):
    import torch

    from moecc.bench import runner

    ab = load_benchmark("hybrid_modes_ab")
    monkeypatch.setattr(ab, "time_training", lambda *args, **kwargs: {"steps": []})
    monkeypatch.setenv("MOECC_OFFLOAD_CACHE_GB", "auto")
    model, _, state = runner.build_for_timing("tiny", None, "hybrid", torch.device("cpu"), None)
    engine = model.moecc.engine
    cache, sizer = engine.slots.cache, engine.slots.cache_sizer
    assert cache is not None and sizer is not None
    ab.time_setting(model, "cpu", 32, 1, "split", {"cache": "off"}, state)
    assert engine.slots.cache is None and engine.slots.cache_sizer is None
    ab.time_setting(model, "cpu", 32, 1, "split", {}, state)
    assert engine.slots.cache is cache and engine.slots.cache_sizer is sizer
    monkeypatch.delenv("MOECC_OFFLOAD_CACHE_GB")
    model, _, state = runner.build_for_timing("tiny", None, "hybrid", torch.device("cpu"), None)
    with pytest.raises(ValueError, match="cache=off asks for a model built with an expert cache"):
        ab.time_setting(model, "cpu", 32, 1, "split", {"cache": "off"}, state)
