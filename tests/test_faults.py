"""The fault table: bad inputs and faults against the public API, each with its exact outcome.

A row either expects an error whose message names the problem (matched on key words, case-insensitive) or a
correct result: a clean step after a failed one equal to a fresh model's, a save that left the old adapter whole.
Routing, finite-check and failed-step rows run under every paradigm.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

import moecc
from moecc import cli
from moecc.adapter_files import install_atomic_save
from moecc.lora import check_finite_gradients
from moecc.tiny_models import tiny_model

from .parity import assert_as_accurate, batches, float64_twin, lora_config, randomize_lora

FAMILY = "qwen3_moe"  # tiny: 2 layers, 8 experts, top-2, H=64, I=32


def prepared(paradigm: str = "cocompute", dtype: torch.dtype = torch.float32, seed: int = 0, lora_seed: int = 5,
             **options) -> torch.nn.Module:
    """A tiny prepared model with non-zero LoRA everywhere (so adapters change the output)."""
    model = moecc.prepare(tiny_model(FAMILY, dtype=dtype, seed=seed), lora_config=lora_config(FAMILY), device="cpu",
                          paradigm=paradigm, config=moecc.MoeccConfig(**options))
    randomize_lora(model, lora_seed)
    return model


BATCH = batches(256, 1, seed=3)[0]  # (ids, mask, labels) of 2 x 12 tokens


def step(model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    """One forward + backward on BATCH: (loss, gradients of the trainable parameters); the gradients are cleared."""
    ids, mask, labels = BATCH
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same_step(model: torch.nn.Module, paradigm: str) -> None:
    """A clean step of ``model`` equals a fresh model's, bit for bit (same weights, same adapters)."""
    loss, grads = step(model)
    fresh_loss, fresh_grads = step(prepared(paradigm))
    assert loss == fresh_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh_grads))


def router_returns(model: torch.nn.Module, change: Callable) -> None:
    """Makes layer 0's router pass its ``(logits, weights, ids)`` through ``change`` (a faulty router)."""
    gate = model.base_model.model.model.layers[0].mlp.gate
    original = gate.forward
    gate.forward = lambda hidden: change(*original(hidden))
    gate.restore = lambda: setattr(gate, "forward", original)


def set_id(value: int):
    def change(logits, weights, ids):
        ids = ids.clone()
        ids[0, 0] = value
        return logits, weights, ids
    return change


def run_batch(model: torch.nn.Module) -> float:
    ids, mask, labels = BATCH
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


# --- fixtures: a good adapter (both formats) and a good sharded checkpoint, copied per row ---------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    model = prepared()
    model.save_pretrained(root / "adapter")
    model.save_pretrained(root / "adapter_bin", safe_serialization=False)
    tiny_model(FAMILY, seed=3).save_pretrained(root / "checkpoint", max_shard_size="100KB")
    return {"adapter": root / "adapter", "adapter_bin": root / "adapter_bin", "checkpoint": root / "checkpoint"}


def copy_of(saved: dict, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[name], tmp_path / name))


def edit_safetensors(file: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def edit_bin(file: Path, change: Callable[[dict], None]) -> None:
    tensors = torch.load(str(file), weights_only=True)
    change(tensors)
    torch.save(tensors, str(file))


def drop_experts(tensors: dict) -> None:
    for key in [k for k in tensors if ".experts." in k]:
        del tensors[key]


def poison(value: float, where: str = ".experts.lora_B"):
    def change(tensors: dict) -> None:
        key = next(k for k in sorted(tensors) if where in k)
        tensors[key][0, 0] = value
    return change


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def load_adapter(directory: Path, family: str = FAMILY, **overrides) -> torch.nn.Module:
    return moecc.prepare(tiny_model(family, **overrides), adapter=directory, device="cpu")


# --- checkpoint editing ------------------------------------------------------------------------------------------

def shard_of(directory: Path, key: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][key]


def other_shard(directory: Path, key: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key])


def add_to_other_shard(directory: Path, key: str, new_key: str | None = None, tensor=None) -> None:
    value = load_file(str(shard_of(directory, key)))[key] if tensor is None else tensor
    edit_safetensors(other_shard(directory, key), lambda t: t.__setitem__(new_key or key, value))


def remove_key(directory: Path, key: str) -> None:
    edit_safetensors(shard_of(directory, key), lambda t: t.pop(key))


def set_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


UP3 = "model.layers.1.mlp.experts.3.up_proj.weight"
UP5 = "model.layers.1.mlp.experts.5.up_proj.weight"


def duplicate_and_gap(directory: Path) -> None:
    """The issue's checkpoint: expert 3's up slice given twice, expert 5's not at all (the counts still add up)."""
    value = load_file(str(shard_of(directory, UP5)))[UP5]
    remove_key(directory, UP5)
    add_to_other_shard(directory, UP3, tensor=value)


def fused_beside_per_expert(directory: Path) -> None:
    fused = tiny_model(FAMILY, seed=3).model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    add_to_other_shard(directory, key, "model.layers.0.mlp.experts.gate_up_proj", fused)


# --- the table of refusals ---------------------------------------------------------------------------------------

@dataclass
class Fault:
    id: str
    run: Callable  # (saved fixtures, tmp_path) -> anything; must raise
    error: type
    words: tuple[str, ...]  # every one must appear in the message (case-insensitive)


def dense_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def meta_model():
    with torch.device("meta"):
        return tiny_model(FAMILY)


def prepare_with(lora=None, **kwargs):
    return moecc.prepare(tiny_model(FAMILY), lora_config=lora, device=kwargs.pop("device", "cpu"), **kwargs)


def targets(*names: str) -> LoraConfig:
    return LoraConfig(r=2, target_modules=["q_proj"], target_parameters=list(names))


def faulty_step(paradigm: str, change: Callable):
    model = prepared(paradigm)
    router_returns(model, change)
    return run_batch(model)


def env_config(**variables):
    previous = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        return moecc.MoeccConfig.from_env()
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def adapter_row(name: str, change: Callable[[Path], None], source: str = "adapter"):
    def run(saved, tmp_path):
        directory = copy_of(saved, source, tmp_path)
        change(directory)
        return load_adapter(directory)
    return run


def checkpoint_row(change: Callable[[Path], None], dtype: torch.dtype = torch.float32):
    def run(saved, tmp_path):
        directory = copy_of(saved, "checkpoint", tmp_path)
        change(directory)
        return moecc.from_pretrained(directory, device="cpu", dtype=dtype)
    return run


def write(relative: str, text: str):
    return lambda d: (d / relative).write_text(text)


def nan_weights(logits, weights, ids):
    weights = weights.clone()
    weights[0, 0] = float("nan")
    return logits, weights, ids


def checked_step(paradigm: str, fault: Callable, check_finite: bool | str = True) -> float:
    """A step of a model prepared with ``check_finite``, after ``fault(model)`` (run to its loss's backward)."""
    model = prepared(paradigm, check_finite=check_finite)
    fault(model)
    ids, mask, labels = BATCH
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item()


def chunked_loss_of(paradigm: str, fault: Callable) -> float:
    from moecc.losses import chunked_causal_lm_loss

    model = prepared(paradigm)
    fault(model)
    return chunked_causal_lm_loss(model, BATCH[0], BATCH[2], chunk_tokens=5).item()


def nan_layer1_expert_lora(model) -> None:
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layers.1.mlp.experts" in n and "lora_B" in n).fill_(float("nan"))


def nan_gradient_into_layer1_experts(model) -> None:
    """Makes the gradient reaching layer 1's MoE block from above NaN (a fault in the layers after it)."""
    def hook(module, args, output):
        output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    model.base_model.model.model.layers[1].mlp.register_forward_hook(hook)


def nan_into_layer1_block(model):
    """Makes the hidden states entering layer 1's MoE block NaN at one position (a fault in the layers before it);
    returns the hook's handle."""
    def hook(module, args, output):
        output = output.clone()
        output[0, 0, 0] = float("nan")
        return output
    return model.base_model.model.model.layers[1].post_attention_layernorm.register_forward_hook(hook)


def routing_faults(paradigm: str) -> list[Fault]:
    """Routing outputs and finite checks refused under ``paradigm``, before the engine's state changes."""
    rows = [
        Fault(f"{paradigm}-expert-id-negative", lambda s, t: faulty_step(paradigm, set_id(-1)), ValueError,
              ("expert id", "-1", "[0, 8)")),
        Fault(f"{paradigm}-expert-id-past-e", lambda s, t: faulty_step(paradigm, set_id(8)), ValueError,
              ("expert id", "8", "[0, 8)")),
        Fault(f"{paradigm}-float-expert-ids", lambda s, t: faulty_step(paradigm, lambda a, w, i: (a, w, i.float())),
              ValueError, ("integer expert ids", "float32")),
        Fault(f"{paradigm}-routing-weights-shape",
              lambda s, t: faulty_step(paradigm, lambda a, w, i: (a, w[:, :1], i)), ValueError,
              ("top_k_weights", "(24, 1)", "top_k_index", "(24, 2)", "shape")),
        Fault(f"{paradigm}-routing-weights-transposed",
              lambda s, t: faulty_step(paradigm, lambda a, w, i: (a, w.t(), i)), ValueError,
              ("top_k_weights", "(2, 24)", "shape")),
        Fault(f"{paradigm}-check-finite-routing", lambda s, t: checked_step(paradigm, lambda m: router_returns(
            m, nan_weights)), MoeccError, ("step 1", "routing weights", "non-finite", "model.layers.0",
                                           "before the layer computed anything")),
        Fault(f"{paradigm}-check-finite-hidden", lambda s, t: checked_step(paradigm, nan_into_layer1_block),
              MoeccError, ("step 1", "input hidden states", "1 non-finite", "model.layers.1", "check_finite=False")),
        Fault(f"{paradigm}-check-finite-loss", lambda s, t: checked_step(paradigm, nan_layer1_expert_lora),
              MoeccError, ("step 1", "loss is nan", "non-finite", "check_finite='all'")),
        Fault(f"{paradigm}-check-finite-chunked-loss", lambda s, t: chunked_loss_of(paradigm, nan_layer1_expert_lora),
              MoeccError, ("step 1", "loss is nan", "non-finite")),
        Fault(f"{paradigm}-check-finite-all-output", lambda s, t: checked_step(paradigm, nan_layer1_expert_lora,
                                                                              "all"),
              MoeccError, ("step 1", "output", "non-finite", "model.layers.1")),
        Fault(f"{paradigm}-check-finite-all-gradient", lambda s, t: checked_step(
            paradigm, nan_gradient_into_layer1_experts, "all"), MoeccError,
              ("step 1", "incoming gradient", "non-finite", "model.layers.1")),
    ]
    rows[0].words += ("invalid routing",)
    rows[1].words += ("invalid routing",)
    return rows


SAFE = "adapter_model.safetensors"
BIN = "adapter_model.bin"
OTHER_USER = 4242  # a uid no account has
INDEX = "model.safetensors.index.json"
MoeccError, Mismatch, LoraError = moecc.MoeccError, moecc.AdapterMismatchError, moecc.UnsupportedLoraConfigError

FAULTS = [
    # model and prepare()
    Fault("dense-model", lambda s, t: moecc.prepare(dense_llama(), device="cpu"), moecc.UnsupportedModelError,
          ("'llama'", "supported: deepseek_v2")),
    Fault("float64-weights", lambda s, t: moecc.prepare(tiny_model(FAMILY).double(), device="cpu"),
          moecc.UnsupportedDtypeError, ("float64", "bfloat16")),
    Fault("meta-weights", lambda s, t: moecc.prepare(meta_model(), device="cpu"), moecc.UnsupportedModelError,
          ("meta", "device_map")),
    Fault("peft-model-passed", lambda s, t: moecc.prepare(prepared(), device="cpu"), MoeccError,
          ("already prepared by moecc",)),
    Fault("unknown-paradigm", lambda s, t: prepare_with(paradigm="turbo"), MoeccError, ("paradigm 'turbo'", "choose")),
    Fault("device-meta", lambda s, t: prepare_with(device="meta"), MoeccError, ("'meta'", "not supported")),
    Fault("gelu-experts", lambda s, t: moecc.prepare(tiny_model(FAMILY, hidden_act="gelu"), device="cpu"),
          moecc.UnsupportedModelError, ("hidden_act='gelu'", "silu")),
    Fault("native-backend-float32", lambda s, t: run_batch(prepared(backend="native")), moecc.UnsupportedModelError,
          ("native", "float32", "MOECC_BACKEND=reference")),
    Fault("lora-config-and-adapter", lambda s, t: prepare_with(lora_config(FAMILY), adapter=s["adapter"]),
          MoeccError, ("either lora_config",)),
    # LoRA configuration
    Fault("lora-config-a-dict", lambda s, t: prepare_with({"r": 2}), LoraError, ("peft.LoraConfig", "dict")),
    Fault("lora-dropout", lambda s, t: prepare_with(lora_config(FAMILY, lora_dropout=0.1)), LoraError,
          ("lora_dropout=0.1", "0.0")),
    Fault("dora", lambda s, t: prepare_with(lora_config(FAMILY, use_dora=True)), LoraError, ("use_dora=True",)),
    Fault("lora-bias", lambda s, t: prepare_with(lora_config(FAMILY, lora_bias=True)), LoraError,
          ("lora_bias=True",)),
    Fault("fan-in-fan-out", lambda s, t: prepare_with(lora_config(FAMILY, fan_in_fan_out=True)), LoraError,
          ("fan_in_fan_out=True",)),
    Fault("target-router-weight", lambda s, t: prepare_with(targets("mlp.gate.weight")), LoraError,
          ("mlp.gate.weight", "routed-expert")),
    Fault("target-matching-nothing", lambda s, t: prepare_with(targets("something.gate_up_proj")), LoraError,
          ("'something.gate_up_proj'", "matches no", "mlp.experts.gate_up_proj")),
    Fault("target-longer-than-any-name",
          lambda s, t: prepare_with(targets("base_model.model.model.layers.0.mlp.experts.gate_up_proj")), LoraError,
          ("matches no",)),
    Fault("lora-rank-zero", lambda s, t: prepare_with(lora_config(FAMILY, rank=0)), LoraError, ("r=0", ">= 1")),
    # adapter directories (prepare(adapter=...))
    Fault("adapter-missing", lambda s, t: load_adapter(t / "nope"), Mismatch, ("does not exist",)),
    Fault("adapter-dir-empty", lambda s, t: load_adapter(t), Mismatch, ("not a PEFT adapter directory",)),
    Fault("adapter-config-without-weights", adapter_row("x", lambda d: (d / SAFE).unlink()), Mismatch,
          ("not a PEFT adapter directory", "adapter_model.bin")),
    Fault("adapter-config-truncated", adapter_row("x", write("adapter_config.json", '{"r": 4, "peft_')), Mismatch,
          ("adapter_config.json", "not valid JSON", "save the adapter again")),
    Fault("adapter-config-a-list", adapter_row("x", write("adapter_config.json", "[1, 2]")), Mismatch,
          ("not a JSON object",)),
    Fault("adapter-not-lora", adapter_row("x", lambda d: write("adapter_config.json", json.dumps(
        {**json.loads((d / "adapter_config.json").read_text()), "peft_type": "PREFIX_TUNING"}))(d)), Mismatch,
          ("PREFIX_TUNING", "not LoRA")),
    Fault("adapter-rank-zero", adapter_row("x", lambda d: write("adapter_config.json", json.dumps(
        {**json.loads((d / "adapter_config.json").read_text()), "r": 0}))(d)), LoraError,
          ("r=0", "whole number >= 1")),
    Fault("adapter-with-dropout", adapter_row("x", lambda d: write("adapter_config.json", json.dumps(
        {**json.loads((d / "adapter_config.json").read_text()), "lora_dropout": 0.1}))(d)), LoraError,
          ("lora_dropout=0.1",)),
    Fault("safetensors-truncated", adapter_row("x", lambda d: truncate(d / SAFE)), Mismatch,
          ("adapter_model.safetensors", "cannot be read", "truncated or corrupted")),
    Fault("safetensors-header-garbage", adapter_row("x", lambda d: (d / SAFE).write_bytes(b"\xff" * 64)), Mismatch,
          ("adapter_model.safetensors", "cannot be read")),
    Fault("safetensors-without-expert-lora", adapter_row("x", lambda d: edit_safetensors(d / SAFE, drop_experts)),
          Mismatch, ("tensors missing", "experts")),
    Fault("safetensors-extra-tensor", adapter_row("x", lambda d: edit_safetensors(
        d / SAFE, lambda t: t.__setitem__("base_model.model.extra.lora_A.weight", torch.zeros(2, 2)))), Mismatch,
          ("no place for", "extra.lora_A")),
    Fault("safetensors-nan", adapter_row("x", lambda d: edit_safetensors(d / SAFE, poison(float("nan")))), Mismatch,
          ("non-finite", "experts.lora_B", "earlier checkpoint")),
    Fault("safetensors-inf-attention", adapter_row("x", lambda d: edit_safetensors(
        d / SAFE, poison(float("inf"), "q_proj.lora_A"))), Mismatch, ("non-finite", "q_proj.lora_A")),
    Fault("safetensors-data-bytes-to-nan", adapter_row("x", lambda d: (d / SAFE).write_bytes(
        (d / SAFE).read_bytes()[:-64] + b"\xff" * 64)), Mismatch, ("non-finite",)),
    Fault("adapter-from-bigger-model", lambda s, t: load_adapter(s["adapter"], hidden_size=32), Mismatch,
          ("shape mismatch",)),
    Fault("adapter-from-other-family", lambda s, t: load_adapter(s["adapter"], family="deepseek_v3"), Mismatch,
          ("does not match this model",)),
    Fault("bin-without-expert-lora", adapter_row("x", lambda d: edit_bin(d / BIN, drop_experts), "adapter_bin"),
          Mismatch, ("tensors missing", "experts")),
    Fault("bin-wrong-shape", adapter_row("x", lambda d: edit_bin(d / BIN, lambda t: t.__setitem__(
        next(k for k in sorted(t) if "q_proj.lora_A" in k), torch.zeros(4, 32))), "adapter_bin"), Mismatch,
          ("shape mismatch", "q_proj.lora_A")),
    Fault("bin-nan", adapter_row("x", lambda d: edit_bin(d / BIN, poison(float("nan"))), "adapter_bin"), Mismatch,
          ("non-finite", "experts.lora_B")),
    Fault("bin-truncated", adapter_row("x", lambda d: truncate(d / BIN), "adapter_bin"), Mismatch,
          ("adapter_model.bin", "cannot be read")),
    Fault("bin-not-a-dict", adapter_row("x", lambda d: torch.save([torch.zeros(1)], str(d / BIN)), "adapter_bin"),
          Mismatch, ("dictionary of tensors",)),
    # checkpoints (from_pretrained)
    Fault("checkpoint-missing", lambda s, t: moecc.from_pretrained(t / "nope"), MoeccError, ("does not exist",)),
    Fault("checkpoint-without-config", lambda s, t: moecc.from_pretrained(t), MoeccError, ("no config.json",)),
    Fault("checkpoint-config-truncated", checkpoint_row(write("config.json", '{"model_type": "qwen3_')), MoeccError,
          ("config.json", "not valid JSON")),
    Fault("checkpoint-not-moe", checkpoint_row(lambda d: set_config(d, model_type="llama")),
          moecc.UnsupportedModelError, ("'llama'", "supported")),
    Fault("checkpoint-quantized", checkpoint_row(lambda d: set_config(d, quantization_config={"quant_method": "fp8"})),
          MoeccError, ("quantized (fp8)", "dequantize")),
    Fault("checkpoint-shard-missing", checkpoint_row(lambda d: shard_of(d, UP3).unlink()), MoeccError,
          ("missing 1 of", "shards")),
    Fault("checkpoint-index-truncated", checkpoint_row(write(INDEX, '{"weight_map": {"model.')), MoeccError,
          ("model.safetensors.index.json", "not valid JSON")),
    Fault("checkpoint-index-without-map", checkpoint_row(write(INDEX, '{"metadata": {}}')), MoeccError,
          ("weight_map",)),
    Fault("checkpoint-without-weights", checkpoint_row(lambda d: [p.unlink() for p in d.glob("model*")]),
          MoeccError, ("no safetensors weights",)),
    Fault("checkpoint-shard-truncated", checkpoint_row(lambda d: truncate(shard_of(d, UP3))), MoeccError,
          ("cannot be read", "truncated or corrupted", "model-0")),
    Fault("checkpoint-other-size", checkpoint_row(lambda d: set_config(d, moe_intermediate_size=40)), MoeccError,
          ("does not match its config.json",)),
    Fault("checkpoint-expert-slice-missing", checkpoint_row(lambda d: remove_key(d, UP3)), MoeccError,
          ("15 of the 16 expert slices", "experts.3.up_proj.weight", "uninitialised")),
    Fault("checkpoint-expert-slice-twice", checkpoint_row(lambda d: add_to_other_shard(d, UP3)), MoeccError,
          ("twice", "experts.3.up_proj.weight")),
    Fault("checkpoint-duplicate-and-gap", checkpoint_row(duplicate_and_gap), MoeccError,
          ("twice", "experts.3.up_proj.weight")),
    Fault("checkpoint-expert-past-config", checkpoint_row(lambda d: add_to_other_shard(
        d, UP3, "model.layers.1.mlp.experts.8.up_proj.weight")), MoeccError, ("expert 8", "8 experts")),
    Fault("checkpoint-fused-beside-per-expert", checkpoint_row(fused_beside_per_expert), MoeccError,
          ("twice", "gate_up_proj")),
    Fault("checkpoint-tensor-in-two-shards", checkpoint_row(lambda d: add_to_other_shard(d, "model.norm.weight")),
          MoeccError, ("model.norm.weight", "both")),
    Fault("checkpoint-unexpected-tensor", checkpoint_row(lambda d: add_to_other_shard(
        d, UP3, "model.layers.0.mlp.extra.weight")), MoeccError, ("no place for", "mlp.extra.weight")),
    Fault("checkpoint-tensor-missing", checkpoint_row(lambda d: remove_key(d, "model.norm.weight")), MoeccError,
          ("missing 1 tensors", "model.norm.weight")),
    Fault("checkpoint-float64", lambda s, t: moecc.from_pretrained(s["checkpoint"], dtype=torch.float64),
          moecc.UnsupportedDtypeError, ("float64",)),
    Fault("target-layer-not-there", lambda s, t: prepare_with(targets("model.layers.99.mlp.experts.gate_up_proj")),
          LoraError, ("layers.99", "matched no parameter")),
    # routing outputs, and the finite checks (MoeccConfig(check_finite=True)), under every paradigm
    *[row for paradigm in ("cocompute", "offload", "hybrid") for row in routing_faults(paradigm)],
    # engine configuration and MOECC_* variables
    Fault("env-threads-zero", lambda s, t: env_config(MOECC_NUM_THREADS="0"), ValueError, ("num_threads", "0")),
    Fault("env-threads-word", lambda s, t: env_config(MOECC_NUM_THREADS="two"), ValueError,
          ("MOECC_NUM_THREADS='two'", "whole number")),
    Fault("env-backend", lambda s, t: env_config(MOECC_BACKEND="fast"), ValueError, ("'fast'", "reference")),
    Fault("env-isa", lambda s, t: env_config(MOECC_ISA="sse"), ValueError, ("'sse'", "avx512_bf16")),
    Fault("env-pin-threads", lambda s, t: env_config(MOECC_PIN_THREADS="maybe"), ValueError,
          ("MOECC_PIN_THREADS='maybe'", "1/true/yes")),
    Fault("env-budget-negative", lambda s, t: env_config(MOECC_GPU_BUDGET_GB="-1"), ValueError,
          ("gpu_memory_budget_gb", "positive", "-1")),
    Fault("env-budget-word", lambda s, t: env_config(MOECC_GPU_BUDGET_GB="lots"), ValueError,
          ("MOECC_GPU_BUDGET_GB='lots'", "number")),
    Fault("env-offload-lora", lambda s, t: env_config(MOECC_OFFLOAD_LORA="gpu"), ValueError, ("'gpu'", "host")),
    Fault("env-offload-slots", lambda s, t: env_config(MOECC_OFFLOAD_SLOTS="0"), ValueError, ("offload_slots", "0")),
    Fault("config-cache-negative", lambda s, t: moecc.MoeccConfig(offload_cache_gb=-1), ValueError,
          ("offload_cache_gb", ">= 0")),
    Fault("config-threads-a-string", lambda s, t: moecc.MoeccConfig(num_threads="4"), MoeccError,
          ("num_threads", "whole number", "'4'", "str", "num_threads=4")),
    Fault("config-threads-fraction", lambda s, t: moecc.MoeccConfig(num_threads=1.5), MoeccError,
          ("num_threads", "whole number", "1.5", "float")),
    Fault("config-threads-huge", lambda s, t: moecc.MoeccConfig(num_threads=10**20), MoeccError,
          ("num_threads", "from 1 to 4096", "100000000000000000000")),
    Fault("config-slots-float", lambda s, t: moecc.MoeccConfig(offload_slots=2.0), MoeccError,
          ("offload_slots", "whole number", "2.0", "offload_slots=2")),
    Fault("config-cache-nan", lambda s, t: moecc.MoeccConfig(offload_cache_gb=float("nan")), MoeccError,
          ("offload_cache_gb", "nan", "not finite", "'auto'")),
    Fault("config-cache-inf", lambda s, t: moecc.MoeccConfig(offload_cache_gb=float("inf")), MoeccError,
          ("offload_cache_gb", "inf", "not finite")),
    Fault("config-cache-word", lambda s, t: moecc.MoeccConfig(offload_cache_gb="lots"), MoeccError,
          ("offload_cache_gb", "'lots'", "'auto'")),
    Fault("config-budget-nan", lambda s, t: moecc.MoeccConfig(gpu_memory_budget_gb=float("nan")), MoeccError,
          ("gpu_memory_budget_gb", "nan", "not finite")),
    Fault("config-budget-inf", lambda s, t: moecc.MoeccConfig(gpu_memory_budget_gb=float("inf")), MoeccError,
          ("gpu_memory_budget_gb", "inf", "not finite")),
    Fault("config-budget-a-string", lambda s, t: moecc.MoeccConfig(gpu_memory_budget_gb="8"), MoeccError,
          ("gpu_memory_budget_gb", "'8'", "str")),
    Fault("config-budget-past-any-gpu", lambda s, t: moecc.MoeccConfig(gpu_memory_budget_gb=1e9), MoeccError,
          ("gpu_memory_budget_gb", "at most 100000", "1e+09")),
    Fault("config-pin-threads-a-string", lambda s, t: moecc.MoeccConfig(pin_threads="false"), MoeccError,
          ("pin_threads", "True or False", "'false'")),
    Fault("config-check-finite-word", lambda s, t: moecc.MoeccConfig(check_finite="yes"), MoeccError,
          ("check_finite", "'all'", "'yes'")),
    Fault("config-split-policy-nan", lambda s, t: moecc.MoeccConfig(split_policy="coldest:nan"), MoeccError,
          ("split_policy", "coldest:nan", "[0, 1]")),
    Fault("config-field-set-later", lambda s, t: set_and_prepare(num_threads="4"), MoeccError,
          ("num_threads", "'4'")),
    Fault("env-threads-huge", lambda s, t: env_config(MOECC_NUM_THREADS="100000000000000000000"), MoeccError,
          ("MOECC_NUM_THREADS='100000000000000000000'", "from 1 to 4096")),
    Fault("env-threads-exponent", lambda s, t: env_config(MOECC_NUM_THREADS="1e20"), MoeccError,
          ("MOECC_NUM_THREADS='1e20'", "whole number")),
    Fault("env-budget-nan", lambda s, t: env_config(MOECC_GPU_BUDGET_GB="nan"), MoeccError,
          ("MOECC_GPU_BUDGET_GB", "nan", "not finite")),
    Fault("env-budget-inf", lambda s, t: env_config(MOECC_GPU_BUDGET_GB="inf"), MoeccError,
          ("MOECC_GPU_BUDGET_GB", "inf", "not finite")),
    Fault("env-cache-nan", lambda s, t: env_config(MOECC_OFFLOAD_CACHE_GB="nan"), MoeccError,
          ("MOECC_OFFLOAD_CACHE_GB", "nan", "not finite")),
    Fault("env-cache-inf", lambda s, t: env_config(MOECC_OFFLOAD_CACHE_GB="inf"), MoeccError,
          ("MOECC_OFFLOAD_CACHE_GB", "inf", "not finite")),
    Fault("env-check-finite-word", lambda s, t: env_config(MOECC_CHECK_FINITE="maybe"), MoeccError,
          ("MOECC_CHECK_FINITE='maybe'", "or all")),
    # the prepared model's inputs
    Fault("ids-zero-length", lambda s, t: run_ids(torch.zeros(2, 0, dtype=torch.long)), MoeccError,
          ("input_ids", "(2, 0)", "empty batch")),
    Fault("ids-empty-batch", lambda s, t: run_ids(torch.zeros(0, 12, dtype=torch.long)), MoeccError,
          ("input_ids", "(0, 12)", "empty batch")),
    Fault("ids-one-token-with-labels", lambda s, t: run_ids(BATCH[0][:, :1], labels=BATCH[0][:, :1]), MoeccError,
          ("step 1", "no label counts", "one token long")),
    Fault("labels-all-masked", lambda s, t: run_ids(BATCH[0], labels=torch.full_like(BATCH[0], -100)), MoeccError,
          ("step 1", "loss is nan", "no label counts", "-100")),
    Fault("ids-past-vocabulary", lambda s, t: run_ids(with_id(300, (1, 3))), MoeccError,
          ("outside the vocabulary [0, 256)", "300 at position (1, 3)", "resize_token_embeddings")),
    Fault("ids-negative", lambda s, t: run_ids(torch.full((1, 4), -1)), MoeccError,
          ("outside the vocabulary", "-1", "(0, 0)")),
    Fault("ids-float", lambda s, t: run_ids(BATCH[0].float()), MoeccError,
          ("input_ids", "integer token ids", "torch.float32", ".long()")),
    Fault("ids-bool", lambda s, t: run_ids(BATCH[0] > 0), MoeccError, ("integer token ids", "torch.bool")),
    Fault("ids-one-dimensional", lambda s, t: run_ids(BATCH[0][0]), MoeccError,
          ("input_ids", "(12,)", "[batch, sequence]", "unsqueeze(0)")),
    Fault("batch-past-host-memory", lambda s, t: run_ids(torch.zeros(1, 1, dtype=torch.long).expand(1, 2**31)),
          MoeccError, ("2,147,483,648 tokens", "gb of host memory", "fewer tokens per step")),
    Fault("prepare-a-prepared-base", lambda s, t: prepare_twice(), MoeccError,
          ("already carries lora", "prepared by moecc", "targeted twice", "fresh copy")),
    # saving
    Fault("save-over-a-file", lambda s, t: save_over_file(t), MoeccError, ("not a directory",)),
    Fault("save-nan-adapter", lambda s, t: save_nan(t), MoeccError, ("not saved", "non-finite", "was not created")),
    Fault("save-into-read-only-directory", lambda s, t: save_into(t, 0o555), MoeccError,
          ("cannot save", "not writable", "dr-xr-xr-x", "does not change")),
    Fault("save-into-read-only-parent", lambda s, t: save_into(t, 0o555, below="new"), MoeccError,
          ("cannot save", "not writable", "dr-xr-xr-x")),
    Fault("save-into-another-users-directory", lambda s, t: save_into(t, 0o755, owner=OTHER_USER), MoeccError,
          ("cannot save", "not writable", f"owner uid {OTHER_USER}")),
]


def with_id(value: int, position: tuple[int, int]) -> torch.Tensor:
    ids = BATCH[0].clone()
    ids[position] = value
    return ids


def run_ids(ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
    return prepared()(input_ids=ids, labels=labels).logits.sum().item()


def set_and_prepare(**fields):
    config = moecc.MoeccConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return moecc.prepare(tiny_model(FAMILY), device="cpu", config=config)


def prepare_twice():
    base = tiny_model(FAMILY)
    moecc.prepare(base, device="cpu")
    return moecc.prepare(base, device="cpu")


def save_into(tmp_path: Path, mode: int, owner: int | None = None, below: str | None = None):
    """Saves into ``tmp_path/'adapter'`` (or ``below`` it) made with ``mode`` and ``owner``; the directory keeps both."""
    directory = tmp_path / "adapter"
    directory.mkdir()
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("making a directory another user owns needs root")
        os.chown(directory, owner, owner)
    os.chmod(directory, mode)
    before = directory.stat()
    model = prepared()
    try:
        model.save_pretrained(directory / below if below else directory)
    finally:
        after = directory.stat()
        os.chmod(directory, 0o755)  # so the test's cleanup can remove it
        assert (after.st_uid, after.st_gid, after.st_mode, after.st_ino) == (
            before.st_uid, before.st_gid, before.st_mode, before.st_ino)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"] and not list(directory.iterdir())

def save_over_file(tmp_path: Path):
    (tmp_path / "adapter").write_text("not a directory")
    model = prepared()
    install_atomic_save(model)
    model.save_pretrained(tmp_path / "adapter")


def save_nan(tmp_path: Path):
    model = prepared()
    install_atomic_save(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "experts.lora_B" in n)[0, 0] = float("nan")
    try:
        model.save_pretrained(tmp_path / "adapter")
    finally:
        assert not (tmp_path / "adapter").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_refused_with_a_clear_message(fault, saved, tmp_path):
    with pytest.raises(fault.error) as raised:
        fault.run(saved, tmp_path / "work" if fault.id.startswith("save") else tmp_path)
    message = str(raised.value).lower()
    missing = [word for word in fault.words if word.lower() not in message]
    assert not missing, f"message lacks {missing}: {raised.value}"


@pytest.fixture(autouse=True)
def _work_dir(tmp_path):
    (tmp_path / "work").mkdir()


def backward_twice(paradigm: str):
    ids, mask, labels = BATCH
    loss = prepared(paradigm)(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("paradigm", PARADIGMS := ["cocompute", "offload", "hybrid"],
                         ids=lambda p: f"{p}-backward-twice")
def test_second_backward_through_one_graph_is_refused(paradigm):
    with pytest.raises(RuntimeError) as raised:
        backward_twice(paradigm)
    assert all(word in str(raised.value) for word in ("saved activations are gone", "forward pass again"))


# --- correct results: targets, adapters, checkpoints -------------------------------------------------------------

def expert_wrapper_names(model) -> list[tuple[int, list[str]]]:
    return [(layer.index, sorted(layer.wrappers)) for layer in model.moecc.layers]


@pytest.mark.parametrize("names,expected", [
    (["gate_up_proj"], [(0, ["gate_up_proj"]), (1, ["gate_up_proj"])]),
    (["model.layers.1.mlp.experts.down_proj"], [(0, []), (1, ["down_proj"])]),
], ids=["short-target-adapts-every-layer", "one-layer-target-adapts-that-layer"])
def test_targets_adapt_exactly_what_they_name(names, expected):
    model = prepare_with(targets(*names))
    assert expert_wrapper_names(model) == expected
    step(model)  # layers with and without expert LoRA run side by side


def test_targets_matched_check_names_a_missing_layer():
    from peft import get_peft_model

    from moecc.lora import check_expert_targets_matched

    good, bad = targets("mlp.experts.down_proj"), targets("model.layers.99.mlp.experts.down_proj")
    check_expert_targets_matched(get_peft_model(tiny_model(FAMILY), good), good)
    with pytest.raises(LoraError, match="'model.layers.99.mlp.experts.down_proj' matched no parameter"):
        check_expert_targets_matched(get_peft_model(tiny_model(FAMILY), bad), bad)


def adapter_values(model) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


@pytest.mark.parametrize("source", ["adapter", "adapter_bin"], ids=["safetensors-loads-exactly", "bin-loads-exactly"])
def test_adapter_loads_with_its_saved_values(source, saved):
    loaded = adapter_values(load_adapter(saved[source]))
    expected = adapter_values(prepared())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_stale_bin_beside_safetensors_is_not_what_loads(saved, tmp_path):
    directory = copy_of(saved, "adapter", tmp_path)
    edit_bin(Path(shutil.copy(saved["adapter_bin"] / BIN, directory / BIN)), drop_experts)  # PEFT reads safetensors
    loaded = adapter_values(load_adapter(directory))
    assert all(torch.equal(loaded[k], v) for k, v in adapter_values(prepared()).items())


def test_failed_adapter_load_leaves_the_model_usable(saved, tmp_path):
    broken = copy_of(saved, "adapter", tmp_path)
    edit_safetensors(broken / SAFE, poison(float("nan")))
    model = tiny_model(FAMILY)
    with pytest.raises(Mismatch):
        moecc.prepare(model, adapter=broken, device="cpu")
    reloaded = moecc.prepare(model, adapter=saved["adapter"], device="cpu")
    assert all(torch.equal(adapter_values(reloaded)[k], v) for k, v in adapter_values(prepared()).items())


def test_sharded_per_expert_checkpoint_loads_with_hf_logits(saved):
    from transformers import AutoModelForCausalLM

    model = moecc.from_pretrained(saved["checkpoint"], device="cpu", dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(saved["checkpoint"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [m(input_ids=BATCH[0]).logits for m in (model, hf, float64_twin(hf))]
        assert_as_accurate(*logits, "logits")


# --- correct results: failed and interrupted steps leave the model as usable as before --------------------------

def fail_in_forward(model):
    """A decoder layer raises after layer 0's experts ran (an error in user code, or a Ctrl-C, mid-forward)."""
    def hook(*_):
        raise KeyboardInterrupt
    handle = model.base_model.model.model.layers[1].register_forward_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        run_batch(model)
    handle.remove()


def fail_in_backward(model):
    """Ctrl-C in backward after layer 1's experts' backward ran and before layer 0's."""
    def hook(module, args, output):
        output.register_hook(lambda grad: (_ for _ in ()).throw(KeyboardInterrupt()))
    handle = model.base_model.model.model.layers[0].register_forward_hook(hook)
    ids, mask, labels = BATCH
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    handle.remove()
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    model.zero_grad(set_to_none=True)


def rejected_routing(model):
    router_returns(model, set_id(-1))
    with pytest.raises(ValueError, match=r"expert ids? .*\[0, 8\)"):
        run_batch(model)
    model.base_model.model.model.layers[0].mlp.gate.restore()


def rejected_weights(model):
    router_returns(model, lambda a, w, i: (a, w[:, :1], i))
    with pytest.raises(ValueError, match="top_k_weights has shape"):
        run_batch(model)
    model.base_model.model.model.layers[0].mlp.gate.restore()


def no_grad_forward(model):
    with torch.no_grad():
        run_batch(model)


def non_finite_routing_weights(model):
    router_returns(model, nan_weights)
    with pytest.raises(MoeccError, match="routing weights .* non-finite"):
        run_batch(model)
    model.base_model.model.model.layers[0].mlp.gate.restore()


def non_finite_hidden_states(model):
    handle = nan_into_layer1_block(model)
    with pytest.raises(MoeccError, match="input hidden states .* non-finite"):
        run_batch(model)
    handle.remove()


def non_finite_loss(model):
    """Layer 1's expert LoRA holds a NaN for one step (no MoE layer after it: the loss names it), then its values."""
    factor = next(p for n, p in model.named_parameters() if "layers.1.mlp.experts" in n and "lora_B" in n)
    kept = factor.detach().clone()
    with torch.no_grad():
        factor.fill_(float("nan"))
    with pytest.raises(MoeccError, match="loss is nan"):
        run_batch(model)
    with torch.no_grad():
        factor.copy_(kept)


def rejected_inputs(model):
    ids, mask, labels = BATCH
    for bad in (ids[:, :0], ids.float(), ids[0], with_id(-3, (0, 2)), torch.zeros(1, 1, dtype=torch.long).expand(
            1, 2**31)):
        with pytest.raises(MoeccError, match="input_ids|host memory"):
            model(input_ids=bad)
    with pytest.raises(MoeccError, match="no label counts"):
        model(input_ids=ids, attention_mask=mask, labels=torch.full_like(labels, -100))


AFTER_FAILURES = [
    pytest.param(fail, paradigm, id=f"{paradigm}-{fail.__name__.replace('_', '-')}")
    for paradigm in PARADIGMS
    for fail in (fail_in_forward, fail_in_backward, rejected_routing, rejected_weights, no_grad_forward,
                 non_finite_routing_weights, non_finite_hidden_states, non_finite_loss, rejected_inputs)
]


@pytest.mark.parametrize("fail,paradigm", AFTER_FAILURES)
def test_clean_step_after_a_failed_one_equals_a_fresh_model(fail, paradigm):
    model = prepared(paradigm)
    fail(model)
    assert_same_step(model, paradigm)


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_one_token_and_no_tokens(paradigm):
    model = prepared(paradigm)
    loss = model(input_ids=BATCH[0][:1, :2], labels=BATCH[0][:1, :2]).loss  # one token predicted
    loss.backward()
    assert torch.isfinite(loss)
    layer = model.moecc.layers[0]
    empty = layer.submit(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).result()
    assert empty.shape == (0, 64)


# --- atomic adapter saves ----------------------------------------------------------------------------------------

@pytest.fixture
def model_and_old(tmp_path):
    """A model whose atomic save writes over an older adapter (other LoRA values) in tmp_path/'out'."""
    old = prepared(lora_seed=11)
    old.save_pretrained(tmp_path / "out")
    model = prepared()
    install_atomic_save(model)
    return model, tmp_path / "out"


def saved_values(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / SAFE if (directory / SAFE).exists() else directory / BIN
    return load_file(str(file)) if file.suffix == ".safetensors" else torch.load(str(file), weights_only=True)


def assert_holds(directory: Path, model) -> None:
    values, expected = saved_values(directory), adapter_values(model)
    assert values.keys() == expected.keys() and all(torch.equal(values[k], expected[k]) for k in expected)


def no_temporaries(directory: Path) -> bool:
    return not [p for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}.moecc-tmp-")]


def test_atomic_save_round_trips(model_and_old):
    model, out = model_and_old
    model.save_pretrained(out)
    assert_holds(out, model)
    assert no_temporaries(out)
    assert torch.equal(run_logits(load_adapter(out)), run_logits(model))


def run_logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=BATCH[0]).logits


@pytest.mark.parametrize("interrupt", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full-mid-write-keeps-old", "ctrl-c-mid-write-keeps-old"])
def test_interrupted_save_leaves_the_old_adapter_whole(model_and_old, monkeypatch, interrupt):
    import peft.peft_model

    model, out = model_and_old
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def half_written(tensors, path, metadata=None):
        Path(path).write_bytes(b"\x00" * 100)  # a partial file, then the failure
        raise interrupt
    monkeypatch.setattr(peft.peft_model, "safe_save_file", half_written)
    with pytest.raises(type(interrupt)):
        model.save_pretrained(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert no_temporaries(out)


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    import peft.peft_model

    model = prepared()
    install_atomic_save(model)
    monkeypatch.setattr(peft.peft_model, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["work"]  # the row fixture's folder only


def test_save_removes_stale_adapter_files_and_keeps_the_rest(model_and_old):
    model, out = model_and_old
    shutil.copy(out / SAFE, out / BIN)  # a legacy weights file from an earlier save
    (out / "other").mkdir()
    (out / "other" / "adapter_config.json").write_text("{}")  # an adapter this model no longer has
    (out / "optimizer.pt").write_bytes(b"optimizer state")  # a Trainer checkpoint's own files
    (out / "runs").mkdir()
    (out / "runs" / "events").write_text("log")
    model.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", SAFE, "moecc_config.json",
                                                     "optimizer.pt", "runs"]
    assert (out / "optimizer.pt").read_bytes() == b"optimizer state" and (out / "runs" / "events").read_text() == "log"
    assert_holds(out, model)


def test_bin_save_over_safetensors_leaves_no_stale_safetensors(model_and_old):
    model, out = model_and_old
    model.save_pretrained(out, safe_serialization=False)
    assert not (out / SAFE).exists()  # PEFT would load a stale safetensors file before the new .bin
    assert_holds(out, model)


def test_nan_save_keeps_the_old_adapter(model_and_old):
    model, out = model_and_old
    before = saved_values(out)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "experts.lora_A" in n)[0, 0] = float("inf")
    with pytest.raises(MoeccError, match="not saved.*non-finite.*is unchanged"):
        model.save_pretrained(out)
    assert all(torch.equal(saved_values(out)[k], v) for k, v in before.items())
    model.save_pretrained(out, check_finite=False)  # asked for explicitly
    assert not torch.isfinite(saved_values(out)[next(k for k in before if "experts.lora_A" in k)]).all()


def test_abandoned_temporary_of_a_dead_save_is_removed(model_and_old):
    model, out = model_and_old
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = out.parent / f".out.moecc-tmp-{dead.stdout.strip()}-deadbeef"
    abandoned.mkdir()
    model.save_pretrained(out)
    assert not abandoned.exists()


def test_save_into_another_users_writable_directory_keeps_its_owner_and_mode(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chown(directory, OTHER_USER, OTHER_USER)
    os.chmod(directory, 0o777)
    model = prepared()
    model.save_pretrained(directory)
    status = directory.stat()
    assert (status.st_uid, status.st_gid, status.st_mode & 0o7777) == (OTHER_USER, OTHER_USER, 0o777)
    assert_holds(directory, model)


def test_prepared_model_saves_atomically():
    from moecc.adapter_files import _atomic_save_pretrained

    assert getattr(prepared().save_pretrained, "__func__", None) is _atomic_save_pretrained


# --- the command line: arguments checked before anything is measured, exit status says what happened -----------

@pytest.fixture
def no_measuring(monkeypatch):
    """Anything that gets past argument checking would measure the machine: make that an error."""
    import moecc.bench.rates

    def measure(*args, **kwargs):
        raise AssertionError("measured before the arguments were checked")
    monkeypatch.setattr(moecc.bench.rates, "measure", measure)


@pytest.mark.parametrize("argv,words", [
    ("plan --tokens 0", ("--tokens", "at least 1")),
    ("plan --tokens -512", ("--tokens", "-512", "at least 1")),
    ("plan --tokens 512,abc", ("--tokens", "'abc'", "whole number")),
    ("plan --tokens 512,,", ("--tokens", "separated by commas")),
    ("plan --layers 0", ("--layers", "at least 1")),
    ("plan --layers -3", ("--layers", "at least 1")),
    ("plan --preset qwen9", ("--preset", "'qwen9'", "qwen3-30b-a3b")),
    ("bench --tokens 0", ("--tokens", "at least 1")),
    ("bench --layers 0", ("--layers", "at least 1")),
    ("bench --paradigms cocompute,turbo", ("--paradigms", "'turbo'", "hf-offload")),
    ("bench --steps 0", ("--steps", "at least 1")),
    ("bench --rank 0", ("--rank", "at least 1")),
    ("bench --gpu-budget -1", ("--gpu-budget", "greater than 0")),
    ("bench --gpu-budget nan", ("--gpu-budget", "greater than 0")),
    ("bench --row-seconds 0", ("--row-seconds", "greater than 0")),
    ("bench --preset nope", ("--preset", "'nope'")),
    ("", ("required", "command")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_cli_refuses_bad_arguments_before_measuring(argv, words, no_measuring, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv.split())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


def fake_bench(monkeypatch, tmp_path, rows_by_paradigm: dict):
    import moecc.bench.plan
    import moecc.bench.rates
    import moecc.bench.report
    import moecc.bench.runner

    monkeypatch.setattr(moecc.bench.rates, "measure", lambda *a, **k: {})
    monkeypatch.setattr(moecc.bench.plan, "predict", lambda *a, **k: {})
    monkeypatch.setattr(moecc.bench.report, "write_report", lambda *a, **k: [tmp_path / "bench.md"])
    monkeypatch.setattr(moecc.bench.runner, "run_case_isolated",
                        lambda preset, layers, paradigm, tokens, *a: [dict(row, paradigm=paradigm, tokens=t)
                                                                      for t, row in zip(tokens, rows_by_paradigm[paradigm])])
    return cli.main(["bench", "--preset", "tiny", "--tokens", "16,32", "--paradigms", "cocompute,offload",
                     "--out", str(tmp_path / "bench")])


TIMED, FAILED = {"step_s": 0.1}, {"error": "CUDA out of memory"}


@pytest.mark.parametrize("rows,status,words", [
    ({"cocompute": [TIMED, TIMED], "offload": [TIMED, TIMED]}, 0, ()),
    ({"cocompute": [TIMED, FAILED], "offload": [TIMED, TIMED]}, 3, ("cocompute at 32 tokens failed", "1 of 4 rows")),
    ({"cocompute": [FAILED, FAILED], "offload": [FAILED, FAILED]}, 1, ("CUDA out of memory", "4 of 4 rows failed")),
    ({"cocompute": [{**TIMED, "error": "caveat"}, TIMED], "offload": [TIMED, TIMED]}, 0, ()),
], ids=["bench-all-timed-exits-0", "bench-some-failed-exits-3", "bench-all-failed-exits-1",
        "bench-timed-with-caveat-exits-0"])
def test_bench_exit_status(rows, status, words, monkeypatch, tmp_path, capsys):
    assert fake_bench(monkeypatch, tmp_path, rows) == status
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


# --- concurrency, packed weights, environment read in C++, finite checks ---------------------------------------

@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_two_threads_forwarding_one_model_get_right_logits(paradigm):
    model = prepared(paradigm, offload_slots=1).eval()  # one slot: each layer call refills what the other reads
    data = batches(256, 4, seed=9)
    with torch.no_grad():
        wanted = [model(input_ids=ids).logits for ids, _, _ in data]
    wrong, errors = [], []

    def work():
        for _ in range(10):
            for (ids, _, _), want in zip(data, wanted):
                try:
                    with torch.no_grad():
                        wrong.append(not torch.equal(model(input_ids=ids).logits, want))
                except MoeccError as error:  # a clear refusal is an accepted outcome
                    errors.append(error)
    threads = [threading.Thread(target=work) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not any(wrong)


def test_prepacked_weights_follow_an_in_place_change():
    def logits(prepack: bool, scale_first: bool):
        base = tiny_model(FAMILY, dtype=torch.bfloat16)
        if scale_first:
            with torch.no_grad():
                for layer in base.model.layers:
                    layer.mlp.experts.gate_up_proj.mul_(2)
        model = moecc.prepare(base, lora_config=lora_config(FAMILY), device="cpu",
                              config=moecc.MoeccConfig(backend="native", prepack_weights=prepack))
        randomize_lora(model, 5)
        if not scale_first:
            with torch.no_grad():
                for layer in model.moecc.layers:
                    layer.experts.gate_up_proj.mul_(2)
        return run_logits(model)
    assert torch.equal(logits(prepack=True, scale_first=False), logits(prepack=False, scale_first=True))


@pytest.mark.skipif(not moecc._ops._C.native_bf16(), reason="this CPU has no AVX512-BF16: the setting has no effect")
@pytest.mark.parametrize("value", ["false", "0", "No"])
def test_native_bf16_off_is_honoured(value):
    code = "import moecc; print(moecc._ops._C.native_bf16())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MOECC_NATIVE_BF16": value}).stdout
    assert out.strip() == "False"


def test_native_bf16_word_is_refused_at_import():
    done = subprocess.run([sys.executable, "-c", "import moecc"], capture_output=True, text=True,
                          env={**os.environ, "MOECC_NATIVE_BF16": "maybe"})
    assert done.returncode != 0 and "MOECC_NATIVE_BF16='maybe'" in done.stderr and "1/true/yes" in done.stderr


def test_non_finite_gradient_names_the_parameter_and_step():
    model = prepared()
    step_loss = model(input_ids=BATCH[0], labels=BATCH[2]).loss
    step_loss.backward()
    check_finite_gradients(model, 7)  # finite: nothing to say
    param_name, param = next((n, p) for n, p in model.named_parameters() if "layers.1.mlp.experts.lora_B" in n)
    param.grad[0, 0] = float("nan")
    with pytest.raises(MoeccError, match=rf"step 7: the gradient of {param_name} has 1 non-finite"):
        check_finite_gradients(model, 7)


def test_trainer_stops_at_a_non_finite_gradient_naming_it(tmp_path):
    from transformers import Trainer, TrainingArguments

    from moecc.integrations import MoeccCallback

    model = prepared()
    bad = next(p for n, p in model.named_parameters() if "layers.0.mlp.experts.base_layer.lora_A" in n)
    bad.register_hook(lambda grad: grad.fill_(float("nan")))
    data = [{"input_ids": row, "labels": row} for row in BATCH[0]]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MoeccCallback()])
    with pytest.raises(MoeccError, match=r"step 1: the gradient of .*layers\.0\.mlp\.experts\.base_layer\.lora_A"):
        trainer.train()
