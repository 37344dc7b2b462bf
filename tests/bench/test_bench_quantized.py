"""benchmarks/bench_quantized_accuracy.py and bench_quantized_capacity.py: what they parse, measure and write."""
from __future__ import annotations

import argparse
import json


from .scripts import load_benchmark

accuracy = load_benchmark("bench_quantized_accuracy")
capacity = load_benchmark("bench_quantized_capacity")


def test_accuracy_reads_the_examples_held_out_lines():
    printed = ("held-out before: loss 2.654, answer accuracy 7.5%\n"
               "held-out after:  loss 1.839, answer accuracy 47.6% (before: 2.654, 7.5%); 3,386 tokens/s\n")
    assert accuracy.HELD_OUT.findall(printed) == [("before", "2.654", "7.5"), ("after", "1.839", "47.6")]
    runs = [{"loss_after": loss, "accuracy_after": 0.4} for loss in (1.0, 1.2, 2.5)]
    assert accuracy.summarize(runs)["loss_after"] == {"median": 1.2, "min": 1.0, "max": 2.5}


def test_accuracy_report_has_a_row_per_format_and_the_weight_errors(tmp_path):
    runs = [{"loss_before": 2.6, "accuracy_before": 0.08, "loss_after": 1.8, "accuracy_after": 0.45}]
    rows = [{"format": f, "group": g, "runs": runs, "summary": accuracy.summarize(runs)} for f, g in accuracy.CASES]
    errors = [{"format": f, "group": g, "relative_error": 0.1, "bytes_per_weight": 0.5, "weights": 10**9}
              for f, g in accuracy.CASES[1:]]
    result = dict(command="python benchmarks/bench_quantized_accuracy.py", commit="abc", cpu="cpu", date="today",
                  steps=300, seeds=[0], weight_layers=1, fine_tune=rows, weight_error=errors)
    accuracy.write_markdown(result, tmp_path)
    accuracy.write_plot(result, tmp_path)
    table = (tmp_path / "accuracy.md").read_text()
    assert "| int4 | 64 | 2.600 (2.600-2.600) | 1.800 (1.800-1.800) | 8.0% (8.0-8.0) | 45.0% (45.0-45.0) |" in table
    assert "| mxfp4 | - | 0.1000 | 0.500 |" in table and (tmp_path / "accuracy.png").stat().st_size > 0


def test_capacity_trains_a_preset_built_straight_into_int4_and_reports_it(tmp_path):
    args = argparse.Namespace(preset="tiny", layers=1, expert_format="int4", int4_group=32, tokens=16, steps=2,
                              rank=2, device="cpu")
    result = capacity.measure(args)
    assert result["expert_format"] == "int4" and result["steps"] == 2 and len(result["steps_s"]) == 2
    assert result["expert_held_gb"] < result["expert_bf16_gb"] / 3
    assert 0 < result["host_rss_after_build_gb"] <= result["peak_host_rss_gb"]
    capacity.write_report(result, "python benchmarks/bench_quantized_capacity.py --preset tiny", tmp_path)
    assert json.loads((tmp_path / "capacity.json").read_text())["int4_group_size"] == 32
    assert "int4 (groups of 32) experts" in (tmp_path / "capacity.md").read_text()
