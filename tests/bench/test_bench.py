"""moecc bench end to end on the tiny preset (the "gpu" paradigm runs on the CPU device here)."""
import json

import pytest
import torch

from moecc import cli
from moecc.bench.presets import PRESETS, preset_config, random_model


def test_bench_writes_table_json_and_plots(tmp_path):
    rows = cli.bench(cli_args(tmp_path))
    assert {(r["paradigm"], r["tokens"]) for r in rows} == {(p, t) for p in ("cocompute", "offload", "gpu")
                                                           for t in (16, 64)}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows)
    for row in rows:  # the stacked parts add up to the step (unless CPU + copies alone exceed it)
        parts = row["cpu_experts_s"] + row["pcie_s"]
        assert abs(parts + row["gpu_other_s"] - row["step_s"]) < 1e-6 or parts > row["step_s"]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert len(saved["rows"]) == 6 and saved["command"].startswith("moecc bench")
    assert "| cocompute | 16 |" in (tmp_path / "bench.md").read_text()
    for plot in ("tokens_per_s.png", "breakdown.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paradigm_that_cannot_run_is_recorded(tmp_path):
    args = cli_args(tmp_path)
    args.paradigms, args.gpu_budget = "gpu", 1e-6  # the whole model cannot fit such a budget
    rows = cli.bench(args)
    assert len(rows) == 2 and all("needs" in row["error"] and "budget" in row["error"] for row in rows)
    assert "needs" in (tmp_path / "bench.md").read_text()


def test_presets_build_real_shapes():
    for name in PRESETS:
        config = preset_config(name, layers=2)
        assert config.num_hidden_layers == 2
    model = random_model("tiny")
    ids = torch.randint(0, 256, (1, 6))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.fixture(autouse=True)
def _rates_cache_in_tmp(tmp_path, monkeypatch):
    from moecc.bench import rates

    monkeypatch.setattr(rates, "CACHE", tmp_path / "rates.json")


def cli_args(out):
    import argparse

    return argparse.Namespace(preset="tiny", layers=None, tokens="16,64", paradigms="cocompute,offload,gpu",
                              gpu_budget=None, steps=1, rank=4, out=str(out))
