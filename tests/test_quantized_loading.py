"""moecc.from_pretrained on quantized checkpoints: FP8 with 128 x 128 block scales as DeepSeek-V3 / Qwen3-FP8 publish
them (per-expert keys, ``weight_scale_inv`` beside each weight) and MXFP4 as gpt-oss does (``*_blocks`` /
``*_scales``), each checked against transformers' own dequantization; conversions while loading; the errors; and
that no shard's file stays mapped after a load."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

import moecc
from moecc.experts.formats import dequantize, quantize
from moecc.store import kernel_view, quantized_matrices
from moecc.tiny_models import tiny_model

from .parity import TOLERANCE, batches, rel_err

INDEX = "model.safetensors.index.json"
# Routed-expert intermediate size of the FP8 checkpoints: a multiple of 128, so gate and up stack in fp8
FP8_SIZE = 128


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _rewrite(directory: Path, change) -> None:
    """Applies ``change(tensors) -> tensors`` to every shard (and the index's weight map)."""
    index_file = directory / INDEX
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    for shard in _shards(directory):
        tensors = change(load_file(str(shard)))
        save_file(tensors, str(shard), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name}
            index["weight_map"].update({key: shard.name for key in tensors})
    if index is not None:
        index_file.write_text(json.dumps(index))


def _set_quantization(directory: Path, **quantization) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


def _fp8_weight(key: str, tensor: torch.Tensor) -> bool:
    """The weights DeepSeek-V3 publishes in FP8: every linear projection but the router's (and the LM head)."""
    return (key.endswith(".weight") and tensor.dim() == 2 and (".self_attn." in key or ".mlp." in key)
            and not key.endswith("mlp.gate.weight"))


def write_fp8_checkpoint(directory: Path, family: str = "deepseek_v3", not_converted: tuple[str, ...] = (),
                         **overrides) -> None:
    """A tiny bf16 model saved the way DeepSeek-V3 / Qwen3-FP8 publish FP8: per-expert keys, e4m3 weights with a
    float32 ``weight_scale_inv`` of their 128 x 128 blocks, modules ``not_converted`` left in bf16."""
    model = tiny_model(family, dtype=torch.bfloat16, seed=5, **{"moe_intermediate_size": FP8_SIZE, **overrides})
    model.save_pretrained(directory, max_shard_size="200KB")

    def to_fp8(tensors: dict) -> dict:
        out = {}
        for key, value in tensors.items():
            module = key.rpartition(".")[0]
            if _fp8_weight(key, value) and not any(module.startswith(m) for m in not_converted):
                q = quantize(value.unsqueeze(0), "fp8")
                out[key], out[key + "_scale_inv"] = q.data[0].view(torch.float8_e4m3fn), q.scales[0]
            else:
                out[key] = value
        return out

    _rewrite(directory, to_fp8)
    _set_quantization(directory, quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                      weight_block_size=[128, 128], modules_to_not_convert=list(not_converted) or None)


def write_mxfp4_checkpoint(directory: Path) -> None:
    """A tiny bf16 gpt-oss saved the way gpt-oss publishes MXFP4: experts as ``*_blocks [E, N, K/32, 16]`` and
    ``*_scales [E, N, K/32]`` in the kernels' orientation, everything else bf16."""
    tiny_model("gpt_oss", dtype=torch.bfloat16, seed=6).save_pretrained(directory)

    def to_mxfp4(tensors: dict) -> dict:
        out = {}
        for key, value in tensors.items():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                q = quantize(value.transpose(1, 2).contiguous(), "mxfp4")  # [E, N, K]
                e, n, k = q.shape
                out[key + "_blocks"], out[key + "_scales"] = q.data.view(e, n, k // 32, 16), q.scales
            else:
                out[key] = value
        return out

    _rewrite(directory, to_mxfp4)
    _set_quantization(directory, quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])


def _hf_dequantized(directory: Path, method: str) -> torch.nn.Module:
    config = FineGrainedFP8Config(dequantize=True) if method == "fp8" else Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=torch.bfloat16).eval()


def _held(model) -> list[dict]:
    return [quantized_matrices(layer.experts) for layer in model.moecc.layers]


def _load(directory: Path, format: str = "auto", **kwargs):
    config = moecc.MoeccConfig(backend="reference", expert_format=format, int4_group_size=32)
    return moecc.from_pretrained(directory, device="cpu", config=config, **kwargs)


def _expert_values(model) -> list[torch.Tensor]:
    """Every layer's expert weights as their bf16 values in the kernels' orientation (gate_up, then down)."""
    out = []
    for layer in model.moecc.layers:
        held = quantized_matrices(layer.experts)
        for name in ("gate_up_proj", "down_proj"):
            out.append(dequantize(held[name]) if held else kernel_view(layer.experts, getattr(layer.experts, name)))
    return out


def _hf_expert_values(hf) -> list[torch.Tensor]:
    experts = [m for n, m in hf.named_modules() if n.endswith("mlp.experts") and hasattr(m, "gate_up_proj")]
    return [kernel_view(e, getattr(e, name).detach()) for e in experts for name in ("gate_up_proj", "down_proj")]


def _logits(model, vocab: int) -> torch.Tensor:
    (ids, mask, _), = batches(vocab, 1, seed=3)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fp8")
    write_fp8_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_fp8_checkpoint(tmp_path_factory) -> Path:
    """Qwen3-FP8's convention: the same keys and scales, the routers listed in modules_to_not_convert."""
    directory = tmp_path_factory.mktemp("qwen3_fp8")
    write_fp8_checkpoint(directory, "qwen3_moe", not_converted=("lm_head", "mlp.gate"))
    return directory


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4_checkpoint(directory)
    return directory


@pytest.mark.parametrize("method,checkpoint", [("fp8", "fp8_checkpoint"), ("fp8", "qwen3_fp8_checkpoint"),
                                               ("mxfp4", "mxfp4_checkpoint")])
def test_checkpoint_stays_in_its_format_with_transformers_values(method, checkpoint, request):
    directory = request.getfixturevalue(checkpoint)
    model = _load(directory)
    hf = _hf_dequantized(directory, method)
    assert model.moecc.expert_format == method and all(h and h["gate_up_proj"].format == method for h in _held(model))
    for ours, theirs in zip(_expert_values(model), _hf_expert_values(hf), strict=True):
        assert torch.equal(ours, theirs)  # the same bf16 value of every weight
    base = dict(model.get_base_model().named_parameters())
    for name, param in hf.named_parameters():  # attention dequantized at load, the rest as stored
        if ".experts." not in name:
            module, _, attr = name.rpartition(".")
            ours = base.get(name, base.get(f"{module}.base_layer.{attr}"))  # LoRA-wrapped projections
            assert ours.dtype == param.dtype and torch.equal(ours, param), name
    assert rel_err(_logits(model, hf.config.vocab_size), _logits(hf, hf.config.vocab_size)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("format", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_another_format_converts_while_loading(method, format, fp8_checkpoint, mxfp4_checkpoint):
    directory = fp8_checkpoint if method == "fp8" else mxfp4_checkpoint
    model = _load(directory, format)
    values = _hf_expert_values(_hf_dequantized(directory, method))
    if format == "bf16":
        assert model.moecc.expert_format == "bfloat16" and not any(_held(model))
        expected = values
    else:  # requantized from the checkpoint's bf16 values
        assert model.moecc.expert_format == format
        expected = [dequantize(quantize(v.contiguous(), format, 32)) for v in values]
    for ours, theirs in zip(_expert_values(model), expected, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_train_save_and_resume(method, fp8_checkpoint, mxfp4_checkpoint, tmp_path):
    directory = fp8_checkpoint if method == "fp8" else mxfp4_checkpoint
    model = _load(directory)
    model.train()
    (ids, mask, labels), = batches(model.config.vocab_size, 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    model.save_pretrained(tmp_path / "adapter")
    settings = json.loads((tmp_path / "adapter" / "moecc_config.json").read_text())
    assert settings["expert_format"] == method and settings["config"]["expert_format"] == "auto"

    resumed = moecc.from_pretrained(directory, adapter=tmp_path / "adapter", device="cpu")
    assert resumed.moecc.expert_format == method and resumed.moecc.config.backend == "reference"
    assert torch.equal(_logits(resumed, model.config.vocab_size), _logits(model, model.config.vocab_size))


def test_fp8_weights_and_scales_in_different_shards(tmp_path):
    write_fp8_checkpoint(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    moved = {"model.layers.0.self_attn.q_b_proj.weight_scale_inv", "model.layers.1.mlp.experts.2.up_proj.weight"}
    tensors = {}
    for shard in {index["weight_map"][key] for key in moved}:
        held = load_file(str(tmp_path / shard))
        tensors.update({key: held.pop(key) for key in moved if key in held})
        save_file(held, str(tmp_path / shard), metadata={"format": "pt"})
    save_file(tensors, str(tmp_path / "model-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({key: "model-extra.safetensors" for key in moved})
    (tmp_path / INDEX).write_text(json.dumps(index))
    model = _load(tmp_path)
    hf = _hf_dequantized(tmp_path, "fp8")
    for ours, theirs in zip(_expert_values(model), _hf_expert_values(hf), strict=True):
        assert torch.equal(ours, theirs)


def test_modules_to_not_convert_are_read_unquantized(tmp_path):
    write_fp8_checkpoint(tmp_path, not_converted=("model.layers.1.self_attn", "model.layers.2.mlp.experts"))
    model = _load(tmp_path)
    held = _held(model)  # layers 1 and 2 are MoE layers; layer 2's experts are stored bf16 and stay bf16
    assert held[0]["gate_up_proj"].format == "fp8" and not held[1]
    assert model.moecc.expert_format == "bfloat16+fp8"
    with pytest.raises(moecc.MoeccError, match="paradigm='offload'.*held in fp8"):
        _load(tmp_path, paradigm="offload")

    _set_quantization(tmp_path, quant_method="fp8", weight_block_size=[128, 128],
                      modules_to_not_convert=["model.layers.0.self_attn"])
    with pytest.raises(moecc.MoeccError, match=r"model.layers.0.self_attn.\w+.weight .* is float8_e4m3fn, but "
                                               "config.json's modules_to_not_convert .* lists"):
        _load(tmp_path)


def _drop(key: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def _replace(key: str, value: torch.Tensor):
    return lambda tensors: {k: (value if k == key else v) for k, v in tensors.items()}


@pytest.mark.parametrize("change,match", [
    (_drop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
     r"model.layers.0.self_attn.o_proj.weight \(model-.*\) is float8_e4m3fn, but no shard holds its block scales "
     "model.layers.0.self_attn.o_proj.weight_scale_inv"),
    (_drop("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
     "model.layers.1.mlp.experts.gate_up_proj's quantized weights without the scales of 3.up"),
    (_replace("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv", torch.ones(2, 2)),
     r"model.layers.1.mlp.experts.3.up_proj.weight_scale_inv .* has shape \(2, 2\), but its weight's 128 x 128 "
     r"blocks need \(1, 1\)"),
    (_replace("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(3)),
     r"o_proj.weight_scale_inv .* has shape \(3,\), but its weight's 128 x 128 blocks need \(1, 1\)"),
    (_replace("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(1, 1, dtype=torch.int32)),
     "o_proj.weight_scale_inv .* is torch.int32; block scales are float32"),
    (_drop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "15 of the 16 expert slices of model.layers.1.mlp.experts.gate_up_proj; missing: "
     "model.layers.1.mlp.experts.3.up_proj.weight"),
], ids=["attention-scale-missing", "expert-scale-missing", "expert-scale-shape", "attention-scale-shape",
        "scale-dtype", "expert-weight-missing"])
def test_fp8_checkpoint_errors_name_the_tensor(change, match, tmp_path):
    write_fp8_checkpoint(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(moecc.MoeccError, match=match):
        _load(tmp_path)


def test_fp8_gate_and_up_that_share_a_block_cannot_stay_fp8(tmp_path):
    write_fp8_checkpoint(tmp_path, moe_intermediate_size=32)  # gate rows 0-31, up rows 32-63: one 128-row block
    for format in ("auto", "fp8"):
        with pytest.raises(moecc.MoeccError, match=r"gate_up_proj: the checkpoint's FP8 gate and up projections "
                                                   r"\(32 rows each\) .* not a multiple of 128.*expert_format='bf16'"):
            _load(tmp_path, format)
    model = _load(tmp_path, "bf16")  # each part dequantized with its own scales
    for ours, theirs in zip(_expert_values(model), _hf_expert_values(_hf_dequantized(tmp_path, "fp8")), strict=True):
        assert torch.equal(ours, theirs)
    assert _load(tmp_path, "int8").moecc.expert_format == "int8"


@pytest.mark.parametrize("quantization,kwargs,error,match", [
    (dict(quant_method="fp8", weight_block_size=[64, 64]), {}, moecc.MoeccError,
     r"quantized \(fp8\) with weight_block_size=\[64, 64\].*128 x 128.*Dequantize it once"),
    (dict(quant_method="fp8", weight_block_size=None), {}, moecc.MoeccError, "weight_block_size=None"),
    (dict(quant_method="fp8", activation_scheme="static"), {}, moecc.MoeccError, "activation_scheme='static'"),
    (dict(quant_method="gptq", bits=4), {}, moecc.MoeccError,
     r"quantized \(gptq\); moecc reads FP8 .* and MXFP4"),
    (dict(quant_method="mxfp4"), {}, moecc.MoeccError, r"quantized \(mxfp4\) but is a 'deepseek_v3' model"),
    (dict(quant_method="fp8"), dict(dtype=torch.float32), moecc.UnsupportedDtypeError,
     r"quantized \(fp8\) and dtype='float32' .* compute in bfloat16: load it with dtype=torch.bfloat16"),
    (dict(quant_method="fp8"), dict(config=moecc.MoeccConfig(expert_format="int4")), moecc.MoeccError,
     "int4 group size 128 does not divide the experts' input size K=64"),
    (dict(quant_method="fp8"), dict(paradigm="hybrid"), moecc.MoeccError,
     "paradigm='hybrid' computes the experts on the device .* held in fp8"),
])
def test_quantization_moecc_cannot_read_is_refused_before_loading(quantization, kwargs, error, match, tmp_path):
    write_fp8_checkpoint(tmp_path)
    _set_quantization(tmp_path, **quantization)
    with pytest.raises(error, match=match):
        moecc.from_pretrained(tmp_path, device="cpu", **kwargs)


def test_a_quantization_config_over_unquantized_weights_is_refused(tmp_path):
    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    _set_quantization(tmp_path, quant_method="fp8", weight_block_size=[128, 128])
    with pytest.raises(moecc.MoeccError, match=r"says the checkpoint is quantized \(fp8\), but none of its tensors"):
        _load(tmp_path, "bf16")


def test_bf16_checkpoint_quantized_while_loading(tmp_path):
    original = tiny_model("qwen3_moe", dtype=torch.bfloat16, seed=2)
    original.save_pretrained(tmp_path, max_shard_size="100KB")
    model = _load(tmp_path, "int4")
    expected = [dequantize(quantize(kernel_view(e, getattr(e, name).detach()).contiguous(), "int4", 32))
                for e in (layer.mlp.experts for layer in original.model.layers) for name in ("gate_up_proj", "down_proj")]
    assert all(h["gate_up_proj"].format == "int4" for h in _held(model))
    for ours, theirs in zip(_expert_values(model), expected, strict=True):
        assert torch.equal(ours, theirs)


def _mapped(directory: Path) -> list[str]:
    """The lines of this process's memory map that map a file under ``directory``."""
    root = str(directory.resolve())
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if root in line]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc/self/maps")
@pytest.mark.parametrize("kind", ["bf16", "fp8", "mxfp4"])
def test_no_shard_stays_mapped_after_loading(kind, tmp_path):
    if kind == "bf16":
        tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    elif kind == "fp8":
        write_fp8_checkpoint(tmp_path)
    else:
        write_mxfp4_checkpoint(tmp_path)
    gc.collect()
    assert not _mapped(tmp_path)
    model = _load(tmp_path)
    gc.collect()
    assert not _mapped(tmp_path), "a tensor still views a shard's file"
    assert _logits(model, model.config.vocab_size).isfinite().all()
