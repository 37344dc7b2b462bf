"""Every example runs as written (with fewer steps) and shows what it claims."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.e2e
def test_finetune_lora_improves_held_out_loss(tmp_path):
    out = _run("finetune_lora.py", "--steps", "40", "--out", str(tmp_path / "adapter"), cwd=tmp_path)
    assert "held-out after" in out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
def test_finetune_lora_trains_the_bf16_variant_on_quantized_experts(tmp_path):
    out = _run("finetune_lora.py", "--steps", "4", "--expert-format", "int4", "--int4-group", "32", "--out",
               str(tmp_path / "adapter"), cwd=tmp_path)
    assert "experts on the CPU (int4)" in out and "held-out after" in out


@pytest.mark.e2e
def test_hf_trainer_logs_moecc_metrics_and_checkpoints(tmp_path):
    out = _run("hf_trainer.py", "--steps", "12", "--out", str(tmp_path / "run"), cwd=tmp_path)
    printed_logs = [line for line in out.splitlines() if line.startswith("{'loss'")]
    assert printed_logs and all("'moecc/cpu_experts_s'" in line for line in printed_logs)
    assert "held-out after" in out
    assert (tmp_path / "run" / "checkpoint-12" / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
def test_compare_paradigms_prints_a_row_per_paradigm(tmp_path):
    out = _run("compare_paradigms.py", "--steps", "1", cwd=tmp_path)
    assert "cocompute" in out and "offload" in out and "gpu" in out


def test_demo_data_is_what_its_script_writes(tmp_path):
    data = (EXAMPLES / "data" / "arithmetic.txt").read_text()
    lines = data.split()
    assert len(lines) == 4000
    assert all(int(a) + int(b) == int(c) for a, rest in (l.split("+") for l in lines) for b, c in [rest.split("=")])


@pytest.mark.e2e
def test_trl_sft_prepares_through_the_callback_and_resumes(tmp_path):
    out = _run("trl_sft.py", "--steps", "4", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert "prepared by moecc: cocompute (2 MoE layers)" in out and "held-out after" in out
    printed_logs = [line for line in out.splitlines() if line.startswith("{'loss'")]
    assert printed_logs and all("'moecc/cpu_experts_s'" in line for line in printed_logs)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "moecc_config.json").is_file()
    resumed = _run("trl_sft.py", "--steps", "4", "--out", str(tmp_path / "run"), "--resume", str(checkpoint),
                   cwd=tmp_path)
    assert "held-out after" in resumed
