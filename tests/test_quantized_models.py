"""moecc.prepare with quantized frozen experts (MoeccConfig.expert_format): one quantized copy in host memory,
training that matches HF + PEFT on the dequantized weights, refusals, and the format travelling with the adapter."""
from __future__ import annotations

import copy
import gc
import json
import logging
import weakref

import pytest
import torch
from peft import PeftModel, get_peft_model

import moecc
from moecc.experts.formats import dequantize, quantize, quantized_bytes
from moecc.store import kernel_view, quantized_matrices
from moecc.tiny_models import tiny_model

from .parity import TOLERANCE, assert_grads_match, batches, forward_backward_both, lora_config, randomize_lora

FORMATS = ("int8", "int4", "fp8", "mxfp4")
FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")  # standard layout; shared experts + a dense layer; transposed
GROUP = 32  # int4 group dividing the tiny models' H = 64 and I = 32


def _config(format: str, **kwargs) -> moecc.MoeccConfig:
    return moecc.MoeccConfig(backend="reference", expert_format=format, int4_group_size=GROUP, **kwargs)


def _routed_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts") and hasattr(m, "gate_up_proj")]


def _dequantized_twin(model: torch.nn.Module, format: str) -> torch.nn.Module:
    """A copy of ``model`` whose routed experts hold ``dequantize(quantize(w))``: the bf16 model HF + PEFT runs as
    the reference of one that moecc holds in ``format``."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for experts in _routed_experts(twin):
            for name in ("gate_up_proj", "down_proj"):
                view = kernel_view(experts, getattr(experts, name).data)  # [E, N, K]
                view.copy_(dequantize(quantize(view.contiguous(), format, GROUP)))
    return twin


def _pair(family: str, format: str, seed: int = 0):
    """(HF + PEFT on the dequantized weights, moecc holding the same weights in ``format``), same adapters."""
    base = tiny_model(family, dtype=torch.bfloat16, seed=seed)
    config = lora_config(family)
    reference = get_peft_model(_dequantized_twin(base, format), copy.deepcopy(config))
    randomize_lora(reference, seed + 100)
    engine = moecc.prepare(base, lora_config=copy.deepcopy(config), device="cpu", config=_config(format))
    lora = {key: value for key, value in reference.state_dict().items() if "lora_" in key}
    assert not engine.load_state_dict(lora, strict=False).unexpected_keys
    reference.train()
    engine.train()
    return reference, engine


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_holds_one_quantized_copy(family, format):
    model = tiny_model(family, dtype=torch.bfloat16)
    plain = moecc.prepare(copy.deepcopy(model), device="cpu", config=_config("bf16"))
    originals = [weakref.ref(getattr(e, name).untyped_storage())
                 for e in _routed_experts(model) for name in ("gate_up_proj", "down_proj")]
    prepared = moecc.prepare(model, device="cpu", config=_config(format))
    gc.collect()
    assert not any(storage() is not None for storage in originals)  # the bf16 weights were released

    total = 0
    assert len(prepared.moecc.layers) == len(originals) // 2
    for experts in (layer.experts for layer in prepared.moecc.layers):
        held = quantized_matrices(experts)
        assert sorted(held) == ["down_proj", "gate_up_proj"]
        for name, q in held.items():
            param = getattr(experts, name)
            assert q.format == format and tuple(q.shape) == tuple(kernel_view(experts, param).shape)
            stored = q.data.untyped_storage().nbytes() + q.scales.untyped_storage().nbytes()
            assert stored <= 1.05 * quantized_bytes(q.shape, format, GROUP)
            assert param.untyped_storage().nbytes() <= param.element_size()  # a placeholder: no storage of its own
            assert param.dtype == torch.bfloat16 and not param.requires_grad
            total += stored
    assert prepared.moecc.expert_bytes == total and prepared.moecc.expert_format == format
    # Attention, dense layers, shared experts and LoRA keep their dtypes; PEFT shaped LoRA from the placeholders
    expected = {name: (p.shape, p.dtype) for name, p in plain.named_parameters()}
    assert {name: (p.shape, p.dtype) for name, p in prepared.named_parameters()} == expected
    assert "ParamWrapper" in repr(prepared)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_peft_on_the_dequantized_weights(family, format):
    reference, engine = _pair(family, format)
    tolerance = TOLERANCE[torch.bfloat16]
    data = batches(reference.config.vocab_size, 2, pad=True)
    forward_backward_both(reference, engine, data[0], tolerance)
    assert_grads_match(reference, engine, tolerance)
    for model in (reference, engine):
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05).step()
        model.zero_grad()
    forward_backward_both(reference, engine, data[1], tolerance)  # after a step on those gradients
    assert_grads_match(reference, engine, tolerance)


@pytest.mark.parametrize("paradigm", ["offload", "hybrid"])
def test_device_paradigms_refuse_quantized_experts(paradigm):
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    before = model.model.layers[0].mlp.experts.gate_up_proj.clone()
    with pytest.raises(moecc.MoeccError, match=f"paradigm='{paradigm}'.*held in int8.*paradigm='cocompute'"):
        moecc.prepare(model, device="cpu", paradigm=paradigm, config=_config("int8"))
    experts = model.model.layers[0].mlp.experts  # left as it was: no LoRA, no quantized copy
    assert not quantized_matrices(experts) and torch.equal(experts.gate_up_proj, before)
    assert moecc.prepare(model, device="cpu", paradigm="auto", config=_config("int8")).moecc.paradigm == "cocompute"


def test_merging_into_quantized_experts_is_refused():
    _, engine = _pair("qwen3_moe", "int4")
    (ids, mask, _), = batches(engine.config.vocab_size, 1)
    with torch.no_grad():
        before = engine(input_ids=ids, attention_mask=mask).logits
    wrapper = engine.get_base_model().model.layers[0].mlp.experts
    for merge in (engine.merge_adapter, engine.merge_and_unload, wrapper.merge):
        with pytest.raises(moecc.MoeccError, match="cannot merge LoRA into the routed experts.*int4.*Save the adapter"):
            merge()
    assert not any(getattr(m, "merged", False) for m in engine.modules())  # nothing merged before the refusal
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids, attention_mask=mask).logits, before)


@pytest.mark.parametrize("family,dtype,kwargs,error,match", [
    ("qwen3_moe", torch.float32, dict(expert_format="int4"), moecc.UnsupportedDtypeError,
     "expert_format='int4' asks for int4 experts, quantized from bfloat16, but .* are float32: load the model in "
     "bfloat16"),
    ("qwen3_moe", torch.float16, dict(expert_format="fp8"), moecc.UnsupportedDtypeError, "are float16"),
    ("qwen3_moe", torch.float32, dict(expert_format="bf16"), moecc.UnsupportedDtypeError,
     "asks for bfloat16 experts.*expert_format='auto' to keep float32"),
    ("qwen3_moe", torch.bfloat16, dict(expert_format="int4", int4_group_size=128), moecc.MoeccError,
     "model.layers.0.mlp.experts.gate_up_proj: int4 group size 128 does not divide the experts' input size K=64.*"
     "int4_group_size"),
    ("mixtral", torch.bfloat16, dict(expert_format="mxfp4"), moecc.MoeccError,
     "down_proj: mxfp4 needs the experts' input size to be a multiple of 32, got K=48"),
])
def test_formats_the_model_cannot_take_are_named(family, dtype, kwargs, error, match):
    model = tiny_model(family, dtype=dtype)
    config = moecc.MoeccConfig(backend="reference", **{"int4_group_size": GROUP, **kwargs})
    with pytest.raises(error, match=match):
        moecc.prepare(model, device="cpu", config=config)
    assert not any(quantized_matrices(e) for e in _routed_experts(model))


def test_auto_and_bf16_keep_bf16_experts():
    for format in ("auto", "bf16"):
        model = moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), device="cpu", config=_config(format))
        assert model.moecc.expert_format == "bfloat16"
        assert all(layer.weights.gate_up_q is None for layer in model.moecc.layers)
    float32 = moecc.prepare(tiny_model("qwen3_moe"), device="cpu", config=_config("auto"))
    assert float32.moecc.expert_format == "float32"


def test_adapter_records_the_format_and_resuming_restores_it(tmp_path, caplog):
    _, engine = _pair("qwen3_moe", "int4")
    (ids, mask, labels), = batches(engine.config.vocab_size, 1)
    engine(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD([p for p in engine.parameters() if p.requires_grad], lr=0.05).step()
    engine.save_pretrained(tmp_path / "adapter")
    settings = json.loads((tmp_path / "adapter" / "moecc_config.json").read_text())
    assert settings["expert_format"] == "int4"
    assert settings["config"]["expert_format"] == "int4" and settings["config"]["int4_group_size"] == GROUP

    resumed = moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), adapter=tmp_path / "adapter", device="cpu")
    assert resumed.moecc.expert_format == "int4" and resumed.moecc.config.int4_group_size == GROUP
    assert resumed.moecc.layers[0].weights.gate_up_q.group == GROUP
    saved = {k: v for k, v in engine.state_dict().items() if "lora_" in k}
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in saved.items())
    with torch.no_grad():
        assert torch.equal(resumed(input_ids=ids, attention_mask=mask).logits,
                           engine(input_ids=ids, attention_mask=mask).logits)

    # Plain PEFT reads the adapter (PEFT's own format) into a bf16 base and merges it there
    plain = PeftModel.from_pretrained(tiny_model("qwen3_moe", dtype=torch.bfloat16), str(tmp_path / "adapter"))
    assert plain.merge_and_unload() is not None

    with caplog.at_level(logging.WARNING, logger="moecc"):
        moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), adapter=tmp_path / "adapter", device="cpu",
                      config=_config("bf16"))
    assert "trained on experts held in int4, this model holds them in bfloat16" in caplog.text


def test_loading_full_weights_into_quantized_experts_is_refused():
    reference, engine = _pair("qwen3_moe", "fp8")
    with pytest.raises(moecc.MoeccError, match=r"cannot load .*mlp.experts.base_layer.base_layer.gate_up_proj: moecc "
                                               "holds these experts' frozen weights in fp8"):
        engine.load_state_dict(reference.state_dict())
    lora = {key: value for key, value in reference.state_dict().items() if "lora_" in key}
    assert not engine.load_state_dict(lora, strict=False).unexpected_keys  # the adapter's tensors alone load
