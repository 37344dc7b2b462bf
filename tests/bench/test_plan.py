"""The planner: predictions from rates, the crossover, and the rate cache."""
import json

import pytest

from moecc import cli
from moecc.bench import rates as rates_module
from moecc.bench.plan import crossover, predict

# The accelerator host's measured rates (DESIGN.md): DRAM 125 GB/s, CPU kernels ~4 TFLOP/s, PCIe 55 GB/s, GPU 790.
HOST = {"dram_gbps": 125.0, "cpu_expert_tflops": 4.0, "h2d_gbps": 55.0, "d2h_gbps": 55.0, "gpu_tflops": 790.0}


def test_predictions_grow_with_tokens_and_cross_over_where_the_design_says():
    small, large = predict("qwen3-30b-a3b", 256, HOST), predict("qwen3-30b-a3b", 8192, HOST)
    assert set(small) == {"cocompute", "offload", "gpu"}
    assert all(large[p] > small[p] for p in small)
    assert small["cocompute"] < small["offload"]  # few tokens per expert: co-compute wins
    assert large["offload"] < large["cocompute"]  # many: offload wins
    point = crossover("qwen3-30b-a3b", HOST)
    assert 512 <= point <= 8192  # DESIGN.md: ~1-2.5k tokens per micro-batch for Qwen3-30B-A3B at 4-8 TFLOP/s


def test_cpu_only_rates_predict_only_cocompute():
    cpu_only = {"dram_gbps": 50.0, "cpu_expert_tflops": 0.5}
    assert set(predict("tiny", 64, cpu_only)) == {"cocompute"}
    assert crossover("tiny", cpu_only) is None


def test_rates_are_measured_once_then_cached(tmp_path, monkeypatch):
    cache = tmp_path / "rates.json"
    monkeypatch.setattr(rates_module, "CACHE", cache)
    first = rates_module.measure()
    assert first["dram_gbps"] > 0 and first["cpu_expert_tflops"] > 0
    cache.write_text(json.dumps({**first, "dram_gbps": 1234.0}))
    assert rates_module.measure()["dram_gbps"] == 1234.0  # from the cache
    out = cli.plan(cli_args())
    assert out["rates"]["dram_gbps"] == 1234.0 and 512 in out["predictions"]


def cli_args():
    import argparse

    return argparse.Namespace(preset="qwen3-30b-a3b", layers=4, tokens="512,2048", remeasure=False)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(rates_module, "CACHE", tmp_path / "rates.json")
