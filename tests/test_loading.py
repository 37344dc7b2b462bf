"""moecc.from_pretrained on local checkpoints: per-expert and fused keys, shards, and clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moecc
from moecc.tiny_models import tiny_model

from .parity import assert_as_accurate, batches, float64_twin


@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", {}), ("qwen3_moe", dict(tie_word_embeddings=True)), ("qwen2_moe", {}), ("deepseek_v3", {}),
    ("mixtral", {}), ("olmoe", {}), ("gpt_oss", {}),
])
def test_sharded_checkpoint_loads_with_hf_logits(family, overrides, tmp_path):
    original = tiny_model(family, seed=3, **overrides)
    original.save_pretrained(tmp_path, max_shard_size="100KB")  # per-expert keys, several shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    if family != "gpt_oss":  # gpt-oss checkpoints keep experts fused
        assert any(".experts.0." in key for key in index["weight_map"])

    model = moecc.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    exact = float64_twin(hf)
    (ids, mask, _), = batches(hf.config.vocab_size, 1, seed=2)
    model.eval()
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits for m in (model, hf, exact)]
        assert_as_accurate(*logits, "logits")
    assert model.moecc.expert_bytes > 0
    assert all(p.device.type == "cpu" for n, p in model.named_parameters() if ".experts." in n)


def test_fused_checkpoint_in_bf16(tmp_path):
    from safetensors.torch import save_file

    original = tiny_model("qwen3_moe", seed=4)
    original.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = moecc.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16)
    experts = model.moecc.layers[0].experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(experts.gate_up_proj, original.model.layers[0].mlp.experts.gate_up_proj.to(torch.bfloat16))


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3_moe").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = tmp_path / index["weight_map"][key]
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(moecc.MoeccError, match="15 of the 16 expert slices of model.layers.1.mlp.experts"):
        moecc.from_pretrained(tmp_path, device="cpu")


def test_checkpoint_errors(tmp_path):
    with pytest.raises(moecc.MoeccError, match="does not exist"):
        moecc.from_pretrained(tmp_path / "missing")
    with pytest.raises(moecc.MoeccError, match="no config.json"):
        moecc.from_pretrained(tmp_path)

    tiny_model("qwen3_moe").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first_shard).rename(tmp_path / "moved.safetensors")
    with pytest.raises(moecc.MoeccError, match=f"missing 1 of .* shards \\(first: {first_shard}\\)"):
        moecc.from_pretrained(tmp_path)
    (tmp_path / "moved.safetensors").rename(tmp_path / first_shard)

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(moecc.MoeccError, match="quantized \\(fp8\\)"):
        moecc.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(moecc.UnsupportedModelError, match="'llama'.*supported: .*qwen3_moe"):
        moecc.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 40}))
    with pytest.raises(moecc.MoeccError, match="does not match its config.json"):
        moecc.from_pretrained(tmp_path, dtype=torch.float32)
    with pytest.raises(moecc.UnsupportedDtypeError, match="float64"):
        moecc.from_pretrained(tmp_path, dtype=torch.float64)


@pytest.mark.parametrize("saved,given,expected", [
    (torch.float32, "auto", torch.float32),  # the checkpoint's dtype: no silent down-cast
    (torch.bfloat16, "auto", torch.bfloat16),
    (torch.float32, "bfloat16", torch.bfloat16),
    (torch.float32, "float16", torch.float16),
    (torch.bfloat16, torch.float32, torch.float32),
], ids=str)
def test_dtype_is_read_as_transformers_reads_it(tmp_path, saved, given, expected):
    tiny_model("qwen3_moe", dtype=saved).save_pretrained(tmp_path)
    model = moecc.from_pretrained(tmp_path, device="cpu", dtype=given)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=given)
    base = {p.dtype for n, p in model.get_base_model().named_parameters() if "lora_" not in n}
    assert base == {expected} == {p.dtype for p in hf.parameters()}


def test_dtype_auto_reads_torch_dtype_and_refuses_others(tmp_path):
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype", "bfloat16")  # older checkpoints' name
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = moecc.from_pretrained(tmp_path, device="cpu")
    assert model.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer.gate_up_proj.dtype == \
        torch.bfloat16
    with pytest.raises(moecc.UnsupportedDtypeError, match="dtype='int8'.*bfloat16"):
        moecc.from_pretrained(tmp_path, device="cpu", dtype="int8")
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float64"}))
    with pytest.raises(moecc.UnsupportedDtypeError, match="config.json dtype='float64'"):
        moecc.from_pretrained(tmp_path, device="cpu")
