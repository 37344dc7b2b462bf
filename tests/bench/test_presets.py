"""Random preset models built straight into a quantized expert format."""
from __future__ import annotations

import pytest
import torch

import moecc
from moecc.bench import runner
from moecc.bench.presets import random_model
from moecc.bench.timing import time_training
from moecc.config import MoeccConfig
from moecc.errors import UnsupportedDtypeError
from moecc.store import EXPERT_PARAMETERS, convert, is_placeholder, kernel_view, quantized_matrices


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize("expert_format", ["int4", "int8", "fp8", "mxfp4"])
def test_quantized_preset_holds_no_bf16_experts_and_matches_the_bf16_model(expert_format):
    bf16 = random_model("tiny", dtype=torch.bfloat16, seed=2)
    quantized = random_model("tiny", dtype=torch.bfloat16, seed=2, expert_format=expert_format, int4_group_size=32)
    for plain, held in zip(_experts(bf16), _experts(quantized)):
        matrices = quantized_matrices(held)
        assert set(matrices) == set(EXPERT_PARAMETERS)
        for name in EXPERT_PARAMETERS:
            param = held._parameters[name]
            assert is_placeholder(param) and param.shape == plain._parameters[name].shape
            assert param.dtype == torch.bfloat16 and not param.requires_grad
            expected = convert(kernel_view(plain, plain._parameters[name].data), expert_format, 32)
            assert matrices[name].format == expert_format
            assert torch.equal(matrices[name].data, expected.data) and torch.equal(matrices[name].scales,
                                                                                   expected.scales)
    bf16_rest = {n: p for n, p in bf16.named_parameters() if ".experts." not in n}
    for name, param in quantized.named_parameters():
        if ".experts." not in name:
            assert torch.equal(param, bf16_rest[name]), name


def test_quantized_preset_trains_a_step_under_cocompute():
    base = random_model("tiny", dtype=torch.bfloat16, expert_format="int4", int4_group_size=32)
    config = MoeccConfig(expert_format="int4", int4_group_size=32, num_threads=1)
    model = moecc.prepare(base, lora_config=moecc.default_lora_config(base, rank=4), device="cpu", config=config)
    assert model.moecc.expert_format == "int4"
    for name, param in model.named_parameters():
        if "lora_B" in name and ".experts" in name:
            param.data.normal_()  # gradients reach lora_A only through a nonzero lora_B
    row = time_training(model, torch.device("cpu"), tokens=32, steps=1, warmup=0)
    assert row["steps_timed"] == 1 and row["step_s"] > 0
    expert_lora = [p for n, p in model.named_parameters() if p.requires_grad and ".experts" in n]
    assert expert_lora and all(torch.isfinite(p).all() for p in expert_lora)


def test_bench_builds_straight_into_the_environments_format(monkeypatch):
    monkeypatch.setenv("MOECC_EXPERT_FORMAT", "int4")
    monkeypatch.setenv("MOECC_INT4_GROUP", "32")
    built = []
    monkeypatch.setattr(runner, "random_model", lambda *args, **kwargs: built.append((args, kwargs)) or
                        random_model(*args, **kwargs))
    model, caveat, _ = runner.build_for_timing("tiny", 1, "cocompute", torch.device("cpu"), None, "off", rank=2)
    assert caveat is None and model.moecc.expert_format == "int4"
    assert built[0][0][2] == torch.bfloat16 and built[0][1] == {"expert_format": "int4", "int4_group_size": 32}


def test_quantized_preset_in_float32_is_refused_before_building():
    with pytest.raises(UnsupportedDtypeError, match="bfloat16"):
        random_model("tiny", dtype=torch.float32, expert_format="int4", int4_group_size=32)
