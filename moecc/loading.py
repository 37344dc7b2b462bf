"""Loading a local Hugging Face MoE checkpoint straight into moecc, shard by shard.

Checks the directory first (config, model type, shards, quantisation) so that problems surface as one clear
message before any weight is read. The model is then built on the meta device and filled one shard at a time:
every non-expert tensor goes straight to the target device, every expert tensor straight into its fused host
tensor (per-expert keys such as ``mlp.experts.<e>.gate_proj.weight`` or Mixtral's ``w1/w2/w3`` land in their
slice of ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``). A shard is closed before the next is opened,
so host memory peaks at the experts (held once) plus one shard.

Quantised checkpoints (FP8, MXFP4) are refused with a message: moecc trains bf16/fp16/fp32 experts, and
dequantising inside the loader would need the quantised kernels' packages; dequantise once, save, then load.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

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


def _shard_files(directory: Path) -> list[Path]:
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        return [directory / n for n in sorted(set(json.loads(index_file.read_text())["weight_map"].values()))]
    return [directory / "model.safetensors"]


# Per-expert checkpoint keys -> (fused parameter, which part). Mixtral's originals use block_sparse_moe/w1-3.
_PER_EXPERT = re.compile(r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<part>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class _ModelFiller:
    """Materialises a meta-device model tensor by tensor: experts into host memory, the rest onto ``device``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.expected = dict(model.named_parameters(remove_duplicate=False))
        self.expected.update(dict(model.named_buffers(remove_duplicate=False)))
        self.expert_parts: dict[str, int] = {}  # fused parameter name -> slices filled
        self.unexpected: list[str] = []

    def _place(self, name: str, tensor: torch.Tensor, device: torch.device) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        target = self.expected[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise MoeccError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(target.shape)}; the checkpoint does not match its config.json")
        value = tensor.to(device=device, dtype=self.dtype if tensor.is_floating_point() else tensor.dtype)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=target.requires_grad)
        else:
            module._buffers[attr] = value

    def _fused(self, name: str) -> torch.Tensor:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        current = getattr(module, attr)
        if current.device.type == "meta":
            current = torch.nn.Parameter(torch.empty(current.shape, dtype=self.dtype), requires_grad=False)
            module._parameters[attr] = current
        return current.data

    def add(self, key: str, tensor: torch.Tensor) -> None:
        key = key.replace(".block_sparse_moe.", ".mlp.")
        if key in self.expected:
            is_expert = ".experts." in key
            self._place(key, tensor, torch.device("cpu") if is_expert else self.device)
            if is_expert:
                self.expert_parts[key] = -1  # loaded whole
            return
        match = _PER_EXPERT.match(key)
        if match is None:
            if not key.endswith("rotary_emb.inv_freq"):
                self.unexpected.append(key)
            return
        experts, expert, part = match["prefix"] + ".mlp.experts", int(match["expert"]), _PART[match["part"]]
        if part == "down":
            name, rows = experts + ".down_proj", slice(None)
        else:
            name = experts + ".gate_up_proj"
            half = self.expected[name].shape[1] // 2
            rows = slice(0, half) if part == "gate" else slice(half, 2 * half)
        if name not in self.expected:
            self.unexpected.append(key)
            return
        fused = self._fused(name)
        if tuple(fused[expert, rows].shape) != tuple(tensor.shape):
            raise MoeccError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(fused[expert, rows].shape)}; the checkpoint does not match its config.json")
        fused[expert, rows].copy_(tensor)
        self.expert_parts[name] = self.expert_parts.get(name, 0) + 1

    def finish(self) -> None:
        """Recomputes non-persistent buffers, ties weights and checks that nothing is left unloaded."""
        if self.unexpected:
            raise MoeccError(f"checkpoint has {len(self.unexpected)} tensors this {self.model.config.model_type} "
                             f"model has no place for (e.g. {self.unexpected[0]})")
        for name, module in list(self.model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding") and any(
                    b.device.type == "meta" for b in module.buffers()):
                parent_name, _, attr = name.rpartition(".")
                fresh = type(module)(config=self.model.config).to(self.device)
                setattr(self.model.get_submodule(parent_name), attr, fresh)
        self.model.tie_weights()
        for name, parts in self.expert_parts.items():
            num_experts = self.expected[name].shape[0]
            needed = num_experts * (2 if name.endswith("gate_up_proj") else 1)
            if parts not in (-1, needed):
                raise MoeccError(f"checkpoint holds {parts} of the {needed} expert slices of {name}; "
                                 "some experts are missing from the shards")
        missing = [n for n, t in list(self.model.named_parameters()) + list(self.model.named_buffers())
                   if t.device.type == "meta"]
        if missing:
            raise MoeccError(f"checkpoint is missing {len(missing)} tensors the model needs (e.g. {missing[0]})")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The checkpoint's causal LM: experts in host memory, everything else on ``device``, in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_checkpoint(path)
    directory = Path(path)
    config = AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    filler = _ModelFiller(model, device, dtype)
    for shard in tqdm(_shard_files(directory), desc="loading shards", unit="shard"):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                filler.add(key, handle.get_tensor(key))
    filler.finish()
    return model.eval()
