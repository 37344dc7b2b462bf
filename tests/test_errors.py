"""Bad input gets a clear error naming the problem and the fix."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

import moecc
from moecc.tiny_models import tiny_model

from .parity import build_pair, lora_config


def test_unsupported_family_lists_supported_ones():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    supported = "deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe"
    with pytest.raises(moecc.UnsupportedModelError, match=f"'llama'.*supported: {supported}"):
        moecc.prepare(dense, device="cpu")


@pytest.mark.parametrize("kwargs,match", [
    (dict(lora_dropout=0.1), "lora_dropout=0.1"),
    (dict(use_dora=True), "use_dora=True"),
])
def test_lora_settings_the_engine_cannot_honour(kwargs, match):
    with pytest.raises(moecc.UnsupportedLoraConfigError, match=match):
        moecc.prepare(tiny_model("qwen3_moe"), lora_config=lora_config("qwen3_moe", **kwargs), device="cpu")


def test_target_parameter_that_is_not_an_expert_weight():
    config = LoraConfig(r=2, target_parameters=["mlp.gate.weight"])
    with pytest.raises(moecc.UnsupportedLoraConfigError, match="mlp.gate.weight"):
        moecc.prepare(tiny_model("qwen3_moe"), lora_config=config, device="cpu")


def test_unsupported_dtype():
    with pytest.raises(moecc.UnsupportedDtypeError, match="float64"):
        moecc.prepare(tiny_model("qwen3_moe").to(torch.float64), device="cpu")


def test_unknown_paradigm_and_missing_cuda():
    with pytest.raises(moecc.MoeccError, match="paradigm 'turbo'"):
        moecc.prepare(tiny_model("qwen3_moe"), paradigm="turbo", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(moecc.MoeccError, match="CUDA is not available"):
            moecc.prepare(tiny_model("qwen3_moe"), device="cuda")


def test_adapter_directory_errors(tmp_path):
    with pytest.raises(moecc.AdapterMismatchError, match="does not exist"):
        moecc.prepare(tiny_model("qwen3_moe"), adapter=tmp_path / "nope", device="cpu")
    with pytest.raises(moecc.AdapterMismatchError, match="not a PEFT adapter directory"):
        moecc.prepare(tiny_model("qwen3_moe"), adapter=tmp_path, device="cpu")


def test_adapter_from_another_model_is_rejected(tmp_path):
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    engine.save_pretrained(tmp_path)
    with pytest.raises(moecc.AdapterMismatchError, match="shape mismatch"):
        moecc.prepare(tiny_model("qwen3_moe", hidden_size=32), adapter=tmp_path, device="cpu")
    with pytest.raises(moecc.AdapterMismatchError, match="does not match this model"):
        moecc.prepare(tiny_model("deepseek_v3"), adapter=tmp_path, device="cpu")


def test_lora_config_and_adapter_together(tmp_path):
    with pytest.raises(moecc.MoeccError, match="either lora_config"):
        moecc.prepare(tiny_model("qwen3_moe"), lora_config=lora_config("qwen3_moe"), adapter=tmp_path, device="cpu")


def test_failed_adapter_load_leaves_the_model_reusable(tmp_path):
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe", rank=2))
    engine.save_pretrained(tmp_path / "good")
    _, other = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe", rank=2), hidden_size=32)
    other.save_pretrained(tmp_path / "bad")
    model = tiny_model("qwen3_moe")
    with pytest.raises(moecc.AdapterMismatchError):
        moecc.prepare(model, adapter=tmp_path / "bad", device="cpu")
    assert not any("lora_" in name for name, _ in model.named_parameters())
    prepared = moecc.prepare(model, adapter=tmp_path / "good", device="cpu")
    assert any("lora_" in name for name, _ in prepared.named_parameters())


def test_second_backward_through_released_graph_is_explained():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    ids = torch.randint(0, 256, (1, 6))
    loss = engine(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="released after the first backward"):
        loss.backward()
