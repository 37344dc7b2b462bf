"""Loading a local Hugging Face MoE checkpoint straight into moecc.

Checks the directory first (config, model type, shards, quantisation) so that problems surface as one clear
message before any weight is read. Weights are then read shard by shard by transformers' own loader into host
memory, which reassembles per-expert checkpoint keys (``experts.<e>.gate_proj`` ...) into the fused expert
tensors, so experts are held once; ``prepare`` then moves everything but the experts to the device.

Quantised checkpoints (FP8, MXFP4) are refused with a message: moecc trains bf16/fp16/fp32 experts, and
dequantising inside the loader would need the quantised kernels' packages; dequantise once, save, then load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import MoeccError, UnsupportedModelError
from .models import FAMILIES


def check_checkpoint(path: str | Path) -> dict:
    """Validates a checkpoint directory; returns its ``config.json`` fields."""
    directory = Path(path)
    if not directory.is_dir():
        raise MoeccError(f"checkpoint directory {str(directory)!r} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise MoeccError(f"{str(directory)!r} has no config.json; pass a Hugging Face checkpoint directory")
    fields = json.loads(config_file.read_text())
    model_type = fields.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"checkpoint model_type {model_type!r} is not a MoE family moecc supports; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    quantization = fields.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown")
        raise MoeccError(
            f"checkpoint is quantized ({method}); moecc trains bf16/fp16/fp32 experts. Dequantize it once "
            "(load with transformers' dequantize option, save_pretrained) and load the bf16 copy"
        )
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise MoeccError(
                f"checkpoint {str(directory)!r} is missing {len(missing)} of {len(shards)} shards "
                f"(first: {missing[0]}); copy the complete checkpoint"
            )
    elif not (directory / "model.safetensors").is_file():
        raise MoeccError(f"no safetensors weights in {str(directory)!r} (model.safetensors or an index + shards)")
    return fields


def load_host_model(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's causal LM with every weight in host memory, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    check_checkpoint(path)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map="cpu")
    except (RuntimeError, ValueError) as error:
        if "mismatch" in str(error) or "shape" in str(error):
            raise MoeccError(
                f"checkpoint {str(path)!r} has weights whose shapes do not match its config.json (transformers' "
                f"load report above lists them); fix config.json or the weights. Original error: {error}"
            ) from error
        raise
