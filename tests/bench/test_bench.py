"""moecc bench end to end on the tiny preset (the "gpu" paradigm runs on the CPU device here)."""
import json

import pytest
import torch

from moecc import cli
from moecc.bench import report
from moecc.bench.presets import PRESETS, preset_config, random_model


def test_bench_writes_table_json_and_plots(tmp_path):
    rows = cli.bench(cli_args(tmp_path))
    assert {(r["paradigm"], r["tokens"]) for r in rows} == {(p, t) for p in ("cocompute", "offload", "gpu")
                                                           for t in (16, 64)}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows)
    for row in rows:  # the stacked parts add up to the step (unless the waits and expert math alone exceed it)
        parts = row["cpu_wait_s"] + row["copy_wait_s"] + row["expert_compute_s"]
        assert abs(parts + row["gpu_other_s"] - row["step_s"]) < 1e-6 or parts > row["step_s"]
        assert row["cpu_wait_s"] == 0 or row["copy_wait_s"] == 0  # one paradigm waits for one thing
        assert row["step_min_s"] <= row["step_s"] <= row["step_max_s"]  # the median within the timed steps' range
        steps = row["steps"]  # each timed step with its engine counters, in order
        assert len(steps) == row["steps_timed"] and min(s["step_s"] for s in steps) == row["step_min_s"]
        assert sorted(s["step_s"] for s in steps)[len(steps) // 2] == row["step_s"]
        if row["paradigm"] == "cocompute":  # the engine's own counters of each step come along
            assert all(s["cpu_experts_s"] > 0 for s in steps)
    cocompute = [row for row in rows if row["paradigm"] == "cocompute"]
    assert all(row["cpu_wait_s"] > 0 for row in cocompute)  # the device waits for the CPU experts in backward
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert len(saved["rows"]) == 6 and saved["command"].startswith("moecc bench")
    assert [s["step_s"] for s in saved["rows"][0]["steps"]] == [s["step_s"] for s in rows[0]["steps"]]
    assert "steps" not in report.COLUMNS  # a list per row: bench.json only
    assert saved["rates"]["dram_gbps"] > 0 and saved["rates"]["shapes"]  # what the predictions came from
    table = (tmp_path / "bench.md").read_text()
    assert "| cocompute | 16 |" in table and "| step_min_s | step_max_s |" in table
    for plot in ("tokens_per_s.png", "breakdown.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paradigm_that_cannot_run_is_recorded(tmp_path):
    args = cli_args(tmp_path)
    args.paradigms, args.gpu_budget = ["gpu"], 1e-6  # the whole model cannot fit such a budget
    rows = cli.bench(args)
    assert len(rows) == 2 and all("needs" in row["error"] and "budget" in row["error"] for row in rows)
    assert "needs" in (tmp_path / "bench.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given where there is no CUDA GPU")
def test_hf_offload_without_cuda_is_an_error_row_end_to_end(tmp_path):
    """The issue's command on a machine without a GPU: hf-offload is reported as an error, not skipped."""
    assert cli.main(["bench", "--preset", "tiny", "--layers", "1", "--tokens", "64", "--steps", "1",
                     "--paradigms", "cocompute,hf-offload", "--out", str(tmp_path)]) == cli.EXIT_SOME_ROWS_FAILED
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [row["paradigm"] for row in rows] == ["cocompute", "hf-offload"]
    assert "error" not in rows[0] and rows[0]["tokens_per_s"] > 0
    assert rows[1]["error"].startswith("hf-offload needs a CUDA GPU") and rows[1]["predicted_step_s"] is None
    table = (tmp_path / "bench.md").read_text()
    assert "| hf-offload | 64 | – | – |" in table and "hf-offload needs a CUDA GPU" in table
    for plot in ("tokens_per_s.png", "breakdown.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_paradigms_include_hf_offload_and_unknown_names_are_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as refused:
        cli.main(["bench", "--paradigms", "cocompute,hf_offload", "--out", str(tmp_path)])
    assert refused.value.code == 2  # argparse names the argument (cli.paradigm_list)
    parsed = []
    monkeypatch.setattr(cli, "bench", lambda args: parsed.append(args) or [])  # the arguments, nothing run
    cli.main(["bench"])
    assert parsed[0].paradigms == ["cocompute", "offload", "hybrid", "gpu", "hf-offload"]


def test_report_shows_errors_in_the_table_and_leaves_them_out_of_the_plots(tmp_path):
    from moecc.bench.report import write_report

    measured = {"step_s": 0.5, "tokens_per_s": 128.0, "peak_gpu_gb": 1.0, "cpu_experts_s": 0.25, "pcie_s": 0.0,
                "gpu_wait_s": 0.0, "gpu_other_s": 0.25, "h2d_gb": 0.0}
    rows = [{"paradigm": "cocompute", "tokens": 64, "predicted_step_s": 0.4, **measured},
            {"paradigm": "hf-offload", "tokens": 64, "predicted_step_s": None, **measured, "error": "a | b"},
            {"paradigm": "hf-offload", "tokens": 128, "predicted_step_s": None, "error": "OutOfMemoryError: x"}]
    write_report(rows, tmp_path, "t", "moecc bench")
    table = (tmp_path / "bench.md").read_text()
    assert "| hf-offload | 64 | 0.5 | – | – | – | 128 |" in table and "a \\| b" in table
    assert "| hf-offload | 128 | – | – | – |" in table and "OutOfMemoryError: x" in table
    write_report(rows[1:], tmp_path / "all_failed", "t", "moecc bench")  # nothing to plot is still a picture
    assert (tmp_path / "all_failed" / "tokens_per_s.png").stat().st_size > 0


def test_presets_build_real_shapes():
    for name in PRESETS:
        config = preset_config(name, layers=2)
        assert config.num_hidden_layers == 2
    model = random_model("tiny")
    ids = torch.randint(0, 256, (1, 6))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.fixture(autouse=True)
def _rates_cache_in_tmp(tmp_path, monkeypatch):
    from moecc.bench import rates_cache

    monkeypatch.setattr(rates_cache, "CACHE", tmp_path / "rates.json")


def cli_args(out):
    import argparse

    return argparse.Namespace(preset="tiny", layers=None, tokens=[16, 64], paradigms=["cocompute", "offload", "gpu"],
                              gpu_budget=None, steps=1, rank=4, out=str(out), checkpointing="auto",
                              row_seconds=None, warmup=1, split_policy=None)


def test_gpu_paradigm_over_budget_is_refused_before_building_the_model(monkeypatch):
    from moecc.bench import runner

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built although it cannot fit")

    monkeypatch.setattr(runner, "random_model", no_build)
    rows = runner.run_case("tiny", 1, "gpu", [16], 1, 4, torch.device("cpu"), budget_gb=1e-6)
    assert "needs" in rows[0]["error"] and "budget is 1e-06 GB" in rows[0]["error"]


def test_max_seconds_times_fewer_steps():
    from moecc.bench.timing import time_training

    model = random_model("tiny", layers=1, dtype=torch.float32)
    assert time_training(model, torch.device("cpu"), 16, steps=4, max_seconds=0.0)["steps_timed"] == 1
    row = time_training(model, torch.device("cpu"), 16, steps=3, max_seconds=1e6)
    assert row["steps_timed"] == 3 and len(row["steps"]) == 3
    assert sorted(s["step_s"] for s in row["steps"])[1] == row["step_s"]  # the median is one of the listed steps


def test_warmup_steps_run_untimed_and_fewer_of_them_past_max_seconds():
    import time

    from moecc.bench.timing import _timed_steps

    calls = []
    model, cpu = torch.nn.Linear(1, 1), torch.device("cpu")
    records, _ = _timed_steps(lambda: calls.append(1), model, cpu, warmup=4, steps=2, max_seconds=None)
    assert len(calls) == 6 and len(records) == 2

    calls.clear()
    slow = lambda: (calls.append(1), time.sleep(0.02))  # noqa: E731
    records, _ = _timed_steps(slow, model, cpu, warmup=4, steps=3, max_seconds=0.01)
    assert len(calls) == 2 and len(records) == 1  # one warm-up step, one timed: each alone past max_seconds


def test_isolated_case_reports_how_its_process_died():
    from moecc.bench.runner import _died

    assert _died(-9) == "was killed by signal 9 (most likely out of host memory)"
    assert _died(-11) == "was killed by signal 11" and _died(1) == "exited with status 1"



def test_random_model_fills_large_tensors_fast_and_deterministically(monkeypatch):
    from moecc.bench import presets

    monkeypatch.setattr(presets, "_DRAWN_ELEMENTS", 1 << 10)  # the tiny model's expert stacks count as large
    a, b = random_model("tiny", seed=3), random_model("tiny", seed=3)
    experts = [(n, p) for n, p in a.named_parameters() if "experts" in n and p.numel() > 1 << 10]
    assert experts
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name  # same seed, same model
    first, second = experts[0][1].flatten(), experts[1][1].flatten()
    assert not torch.equal(first[:1024], second[:1024])  # tiles start at different random offsets
    assert abs(first.float().std().item() - 0.02) < 0.002


def test_auto_checkpointing_retries_an_out_of_memory_step(monkeypatch):
    """Under ``auto`` a token count that runs out of GPU memory is timed again with gradient checkpointing on,
    which stays on for the larger counts; ``off`` records the failure instead."""
    from moecc.bench import runner

    calls = []

    def fake_time_training(model, device, count, steps, warmup=1, max_seconds=None, profile_gpu=True):
        on = bool(getattr(model, "is_gradient_checkpointing", False))
        calls.append((count, on))
        if count >= 64 and not on:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"step_s": 1.0}

    monkeypatch.setattr(runner, "time_training", fake_time_training)
    rows = runner.run_case("tiny", 1, "cocompute", [16, 64, 128], 1, 4, torch.device("cpu"), None)
    assert [(r["tokens"], r["checkpointing"], "error" in r) for r in rows] == [
        (16, False, False), (64, True, False), (128, True, False)]
    assert calls == [(16, False), (64, False), (64, True), (128, True)]
    rows = runner.run_case("tiny", 1, "cocompute", [16, 64], 1, 4, torch.device("cpu"), None, checkpointing="off")
    assert "error" not in rows[0] and "out of memory" in rows[1]["error"]
    with pytest.raises(ValueError, match="checkpointing must be one of"):
        runner.run_case("tiny", 1, "cocompute", [16], 1, 4, torch.device("cpu"), None, checkpointing="maybe")


def test_isolated_case_turns_a_crashed_process_into_error_rows():
    from moecc.bench.runner import run_case_isolated

    # steps=None makes the child fail with a TypeError inside the timing loop, an unexpected crash
    rows = run_case_isolated("tiny", 1, "cocompute", [16, 32], None, 4, torch.device("cpu"), None)
    assert [row["tokens"] for row in rows] == [16, 32]
    assert all(row["error"].startswith("the benchmark process exited with status 1") for row in rows)


@pytest.mark.parametrize("set_by_user", [None, "LAZY"])
def test_isolated_hybrid_rows_load_cuda_kernels_eagerly_unless_the_user_chose(set_by_user, monkeypatch):
    """Hybrid's GPU waits for its CPU parts only under eager kernel loading (moecc.paradigms.device_wait), so the
    bench's hybrid process gets CUDA_MODULE_LOADING=EAGER, and the other paradigms' the user's setting."""
    import subprocess

    from moecc.bench import runner

    seen = {}

    def child(args, env, check):  # the child's paradigm and loading mode; no rows come back
        seen[json.loads(args[3])["paradigm"]] = env.get("CUDA_MODULE_LOADING")
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(subprocess, "run", child)
    if set_by_user:
        monkeypatch.setenv("CUDA_MODULE_LOADING", set_by_user)
    else:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    for paradigm in ("hybrid", "offload"):
        runner.run_case_isolated("tiny", 1, paradigm, [16], 1, 4, torch.device("cpu"), None)
    assert seen == {"hybrid": set_by_user or "EAGER", "offload": set_by_user}


def test_random_model_routes_like_a_trained_one():
    """Tokens spread over all experts in every layer (a plain N(0, 0.02) init piles them on a few)."""
    model = random_model("tiny", layers=6, dtype=torch.float32)
    loads = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda mod, args, out: loads.append(torch.bincount(
                out[2].reshape(-1), minlength=model.config.num_experts).float()))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(0)))
    assert len(loads) == 6
    for load in loads:
        assert (load > 0).all() and load.max() / load.mean() < 1.5, load


def test_hf_offload_check_that_runs_out_of_memory_is_retried_with_checkpointing(monkeypatch):
    """Under ``auto`` the stock route's first step (the expert-LoRA check) may not fit either: it gets gradient
    checkpointing like a timed step would; with ``off`` the failure stands."""
    from peft import get_peft_model

    from moecc.api import default_lora_config
    from moecc.bench import hf_offload, runner

    calls = []

    def check(model, device):
        calls.append(bool(getattr(model, "is_gradient_checkpointing", False)))
        if not calls[-1]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return None

    monkeypatch.setattr(hf_offload, "build", lambda base, lora, device: get_peft_model(base, lora))
    monkeypatch.setattr(hf_offload, "untrained_expert_lora", check)
    base = random_model("tiny", layers=1, dtype=torch.float32)
    state = {"mode": "auto", "on": False}
    model, caveat = runner._hf_offload(base, default_lora_config(base, rank=4), torch.device("cpu"), None, state)
    assert calls == [False, True] and state["on"] and caveat is None and model.is_gradient_checkpointing
    calls.clear()  # --checkpointing on: the check step already runs with it
    base = random_model("tiny", layers=1, dtype=torch.float32)
    runner._hf_offload(base, default_lora_config(base, rank=4), torch.device("cpu"), None, {"mode": "on", "on": True})
    assert calls == [True]
    base = random_model("tiny", layers=1, dtype=torch.float32)
    with pytest.raises(torch.OutOfMemoryError):
        runner._hf_offload(base, default_lora_config(base, rank=4), torch.device("cpu"), None,
                           {"mode": "off", "on": False})


def test_gpu_kernel_busy_time_merges_overlaps_and_leaves_out_copies():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from moecc.bench.timing import gpu_kernel_busy_s

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event("gemm", 0, 100), event("lora", 50, 150),  # overlapping: 150 us together
              event("Memcpy HtoD (Pinned -> Device)", 150, 400), event("Memset (Device)", 400, 410),
              event("aten::mm", 0, 1000, DeviceType.CPU),  # host-side op
              event("moecc.offload.copy_experts", 100, 900, annotation=True),  # a record_function range
              event("silu", 500, 520)]
    assert gpu_kernel_busy_s(events) == pytest.approx(170e-6)
    assert gpu_kernel_busy_s([]) == 0.0


def test_bench_optimizer_is_fused_where_it_can_be():
    """The Trainer's default optimizer (fused AdamW); the for-each one when a parameter is a meta placeholder."""
    from moecc.bench.timing import adamw

    model = torch.nn.Linear(4, 4)
    assert adamw(model.parameters()).defaults["fused"] is True
    model.bias = torch.nn.Parameter(torch.zeros(4, device="meta"))
    assert not adamw(model.parameters()).defaults["fused"]


def test_breakdown_plot_shows_each_sides_busy_time_beside_the_step(tmp_path, monkeypatch):
    """Hybrid's CPU experts and PCIe copies each busy for most of the step: two bars beside the stacked step, both
    near its height, which only both sides working at once can give."""
    figures = []
    monkeypatch.setattr(report, "_save", lambda plt, fig, rows, path: figures.append(fig))
    row = {"paradigm": "hybrid", "tokens": 2048, "step_s": 2.1, "cpu_wait_s": 1.2, "copy_wait_s": 0.6,
           "expert_compute_s": 0.3, "gpu_other_s": 0.0, "cpu_experts_s": 1.45, "pcie_s": 2.0}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report._breakdown_plot(plt, [row], "t", tmp_path / "b.png")
    bars = {container.get_label(): [patch.get_height() for patch in container.patches]
            for container in figures[0].axes[0].containers}
    assert bars["CPU experts busy (beside the step)"] == [1.45] and bars["PCIe copies busy (beside the step)"] == [2.0]
    assert sum(bars[label][0] for label in bars if "busy" not in label) == pytest.approx(2.1)
    plt.close(figures[0])
