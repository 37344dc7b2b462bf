"""The stock HF + accelerate offload baseline (``hf-offload``): device map, dispatch, and whether it trains.

Without a GPU the route runs with accelerate's disk offload (the same hooks, loading experts from files onto the
CPU); the GPU tests run the real thing.
"""
import pytest
import torch
from accelerate.utils import align_module_device, check_device_map
from peft import get_peft_model

from moecc.api import default_lora_config
from moecc.bench import hf_offload
from moecc.bench.runner import run_case, run_case_isolated
from moecc.bench.timing import time_training
from moecc.models import FAMILIES
from moecc.tiny_models import tiny_model

FAMILY_NAMES = sorted(FAMILIES)


def build_tiny(family: str, device: torch.device, offload_dir=None):
    base = tiny_model(family).train()
    return hf_offload.build(base, default_lora_config(base, rank=4), device, offload_dir=offload_dir)


def expert_lora_values(model) -> dict[str, torch.Tensor]:
    """The expert LoRA tensors accelerate will load at the next forward (host copies)."""
    values = {}
    for name in hf_offload.expert_module_names(model):
        module = model.get_submodule(name)
        with align_module_device(module, "cpu"):
            values.update({f"{name}.{key}": value.clone() for key, value in module.state_dict().items()
                           if "lora_" in key})
    return values


def attention_lora_values(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()
            if p.requires_grad and ".experts." not in name}


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_device_map_offloads_only_the_experts(family):
    base = tiny_model(family)
    model = get_peft_model(base, default_lora_config(base, rank=4))
    experts = hf_offload.expert_module_names(model)
    assert experts and all(name.endswith("mlp.experts") for name in experts)
    device_map = hf_offload.offload_device_map(model, experts, 0)
    check_device_map(model, device_map)  # every weight is placed
    assert {name for name, where in device_map.items() if where == "cpu"} == set(experts)
    assert all(where == 0 for name, where in device_map.items() if name not in experts)
    assert not any(b.startswith(f"{a}.") for a in device_map for b in device_map)  # disjoint modules


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_disk_offload_runs_and_says_whether_expert_lora_trains(family, tmp_path):
    """The verdict from gradients agrees with what the next forward would load after a training step."""
    model = build_tiny(family, torch.device("cpu"), offload_dir=str(tmp_path))
    assert all(p.device.type == "meta" for name, p in model.named_parameters() if ".experts." in name)
    verdict = hf_offload.untrained_expert_lora(model, torch.device("cpu"))
    experts_before, attention_before = expert_lora_values(model), attention_lora_values(model)
    assert experts_before
    result = time_training(model, torch.device("cpu"), tokens=16, steps=1)
    assert result["tokens_per_s"] > 0
    assert changed(attention_before, attention_lora_values(model))
    assert (verdict is None) == changed(experts_before, expert_lora_values(model))
    # accelerate 1.15 + peft 0.21: the optimizer's expert LoRA tensors are meta placeholders, replaced each forward
    assert verdict is not None and "expert LoRA does not train" in verdict


def test_build_needs_cuda_or_an_offload_folder():
    base = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="CUDA device"):
        hf_offload.build(base, default_lora_config(base, rank=4), torch.device("cpu"))


def test_run_case_without_cuda_records_why():
    rows = run_case("tiny", 1, "hf-offload", [16, 64], steps=1, rank=4, device=torch.device("cpu"), budget_gb=None)
    assert [row["tokens"] for row in rows] == [16, 64]
    assert all(row["error"].startswith("hf-offload needs a CUDA GPU") and "step_s" not in row for row in rows)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    yield torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)  # run_case caps it at the budget


@pytest.mark.gpu
def test_cuda_build_keeps_experts_on_host_and_trains_attention(cuda):
    model = build_tiny("qwen3_moe", cuda)
    for name, param in model.named_parameters():
        assert param.device.type == ("meta" if ".experts." in name else "cuda"), name
    verdict = hf_offload.untrained_expert_lora(model, cuda)
    experts_before, attention_before = expert_lora_values(model), attention_lora_values(model)
    result = time_training(model, cuda, tokens=64, steps=1)
    assert result["tokens_per_s"] > 0 and result["peak_gpu_gb"] > 0
    assert changed(attention_before, attention_lora_values(model))
    assert (verdict is None) == changed(experts_before, expert_lora_values(model))


@pytest.mark.gpu
def test_cuda_run_case_times_it_under_budget(cuda):
    budget_gb = 0.5
    rows = run_case("tiny", 1, "hf-offload", [64, 256], steps=2, rank=4, device=cuda, budget_gb=budget_gb)
    assert [row["tokens"] for row in rows] == [64, 256]
    for row in rows:  # it runs; the only error allowed is the caveat that comes with the times
        assert row["tokens_per_s"] > 0 and 0 < row["peak_gpu_gb"] <= budget_gb, row
        assert "error" not in row or row["error"].startswith("expert LoRA does not train"), row


@pytest.mark.gpu
def test_cuda_over_budget_records_out_of_memory(cuda):
    # In a process of its own, as `moecc bench` runs it: in this one, blocks other tests left cached serve the
    # small allocations without asking the capped allocator for more.
    rows = run_case_isolated("tiny", 1, "hf-offload", [64], steps=1, rank=4, device=cuda, budget_gb=1e-4)
    assert len(rows) == 1 and "OutOfMemoryError" in rows[0]["error"], rows


@pytest.mark.gpu
def test_cuda_gpu_paradigm_stays_under_budget(cuda):
    budget_gb = 0.5
    rows = run_case("tiny", 1, "gpu", [64, 256], steps=1, rank=4, device=cuda, budget_gb=budget_gb)
    for row in rows:
        assert "error" not in row and 0 < row["peak_gpu_gb"] <= budget_gb, row
