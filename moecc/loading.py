"""Loading a local Hugging Face MoE checkpoint straight into moecc, shard by shard.

Checks the directory first (config, model type, shards, quantisation) so that problems surface as one clear
message before any weight is read. The model is then built on the meta device and filled one shard at a time:
every non-expert tensor goes straight to the target device, every expert tensor straight into its fused host
tensor (per-expert keys such as ``mlp.experts.<e>.gate_proj.weight`` or Mixtral's ``w1/w2/w3`` land in their
slice of ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``). A shard is closed before the next is opened,
so host memory peaks at the experts (held once) plus one shard.

Every expert slice is accounted for by name: a slice given twice (in one shard or two, or per expert beside the
fused tensor), an expert index past the config's count, and a slice no shard holds are each refused with the
keys named, because a fused tensor with a gap would otherwise hold uninitialised memory.

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

from .errors import MoeccError, UnsupportedDtypeError, UnsupportedModelError
from .models import FAMILIES

_INDEX = "model.safetensors.index.json"


def read_json_object(path: Path, what: str, fix: str = "copy the file again from the original checkpoint",
                     error: type[MoeccError] = MoeccError) -> dict:
    """A JSON object from ``path``; a truncated or hand-edited file raises ``error`` naming ``what`` it is, the
    parser's position and the ``fix``."""
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as problem:
        raise error(f"{what} {str(path)!r} is not valid JSON ({problem}); {fix}") from None
    if not isinstance(fields, dict):
        raise error(f"{what} {str(path)!r} holds a {type(fields).__name__}, not a JSON object")
    return fields



def _index_shards(directory: Path) -> list[str]:
    """Shard file names listed by the checkpoint's index, sorted."""
    index = read_json_object(directory / _INDEX, "checkpoint index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise MoeccError(f"checkpoint index {str(directory / _INDEX)!r} has no 'weight_map' of tensor names to "
                         "shard files; copy it again from the original checkpoint")
    return sorted(set(weight_map.values()))


def check_checkpoint(path: str | Path) -> dict:
    """Validates a checkpoint directory; returns its ``config.json`` fields."""
    directory = Path(path)
    if not directory.is_dir():
        raise MoeccError(f"checkpoint directory {str(directory)!r} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise MoeccError(f"{str(directory)!r} has no config.json; pass a Hugging Face checkpoint directory")
    fields = read_json_object(config_file, "checkpoint config")
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
    if (directory / _INDEX).is_file():
        shards = _index_shards(directory)
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise MoeccError(
                f"checkpoint {str(directory)!r} is missing {len(missing)} of {len(shards)} shards "
                f"(first: {missing[0]}); copy the complete checkpoint"
            )
    elif not (directory / "model.safetensors").is_file():
        raise MoeccError(f"no safetensors weights in {str(directory)!r} (model.safetensors or an index + shards)")
    return fields


SUPPORTED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _dtype_from_name(name: str, what: str) -> torch.dtype:
    """``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``... as a dtype moecc trains, or an error naming ``what``."""
    key = name.strip().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(f"{what}={name!r}; moecc trains {', '.join(SUPPORTED_DTYPES)} weights (a "
                                    "quantised checkpoint must be dequantised first)")
    return SUPPORTED_DTYPES[key]


def resolve_dtype(dtype: str | torch.dtype, fields: dict) -> torch.dtype:
    """The dtype to load in, as transformers reads ``dtype``: ``"auto"`` is the checkpoint's own (config.json's
    ``dtype``, or ``torch_dtype`` as older checkpoints name it; float32 when it names none, transformers' default),
    a string names a dtype, a ``torch.dtype`` is itself. Nothing is down-cast unless asked for."""
    if isinstance(dtype, torch.dtype):
        return _dtype_from_name(str(dtype), "dtype")
    if not isinstance(dtype, str):
        raise UnsupportedDtypeError(f"dtype={dtype!r}: pass 'auto', a dtype name ('bfloat16') or a torch.dtype")
    if dtype.strip() != "auto":
        return _dtype_from_name(dtype, "dtype")
    saved = fields.get("dtype") or fields.get("torch_dtype")
    if saved is None:
        return torch.float32
    return _dtype_from_name(str(saved), "the checkpoint's config.json dtype")


def _shard_files(directory: Path) -> list[Path]:
    if (directory / _INDEX).is_file():
        return [directory / name for name in _index_shards(directory)]
    return [directory / "model.safetensors"]


# Per-expert checkpoint keys -> (fused parameter, which part). Mixtral's originals use block_sparse_moe/w1-3.
_PER_EXPERT = re.compile(r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<part>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PART_KEY = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_WHOLE = "whole"  # the fused tensor itself, given in one piece


def _parts_of(name: str) -> tuple[str, ...]:
    return ("gate", "up") if name.endswith("gate_up_proj") else ("down",)


def _listing(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class _ModelFiller:
    """Materialises a meta-device model tensor by tensor: experts into host memory, the rest onto ``device``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.expected = dict(model.named_parameters(remove_duplicate=False))
        self.expected.update(dict(model.named_buffers(remove_duplicate=False)))
        # fused parameter name -> {(expert, part) or WHOLE: the key and shard that filled it}
        self.expert_slices: dict[str, dict] = {}
        self.seen: dict[str, str] = {}  # non-expert key -> shard it came from
        self.unexpected: list[str] = []
        self.shard = ""  # file name of the shard being read, for messages

    def _place(self, name: str, tensor: torch.Tensor, device: torch.device) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        target = self.expected[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise MoeccError(f"checkpoint tensor {name} ({self.shard}) has shape {tuple(tensor.shape)}, the config "
                             f"implies {tuple(target.shape)}; the checkpoint does not match its config.json")
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

    def _claim(self, name: str, piece, key: str) -> None:
        """Records that ``key`` fills ``piece`` of the fused parameter ``name``; a second filler is refused."""
        slices = self.expert_slices.setdefault(name, {})
        if piece == _WHOLE:
            clash = next(iter(slices.values()), None)
        else:
            clash = slices.get(piece) or slices.get(_WHOLE)
        if clash is not None:
            earlier_key, earlier_shard = clash
            raise MoeccError(
                f"checkpoint gives {name} twice: {key} ({self.shard}) and {earlier_key} ({earlier_shard}) fill the "
                "same expert slice; the shards come from different saves, copy the checkpoint again"
            )
        slices[piece] = (key, self.shard)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        key = key.replace(".block_sparse_moe.", ".mlp.")
        if key in self.expected:
            is_expert = ".experts." in key
            if is_expert:
                self._claim(key, _WHOLE, key)
            elif key in self.seen:
                raise MoeccError(f"checkpoint tensor {key} is in both {self.seen[key]} and {self.shard}; the shards "
                                 "come from different saves, copy the checkpoint again")
            else:
                self.seen[key] = self.shard
            self._place(key, tensor, torch.device("cpu") if is_expert else self.device)
            return
        match = _PER_EXPERT.match(key)
        if match is None:
            if not key.endswith("rotary_emb.inv_freq"):
                self.unexpected.append(key)
            return
        self._add_expert_slice(key, match, tensor)

    def _add_expert_slice(self, key: str, match: re.Match, tensor: torch.Tensor) -> None:
        experts, expert, part = match["prefix"] + ".mlp.experts", int(match["expert"]), _PART[match["part"]]
        name = experts + (".down_proj" if part == "down" else ".gate_up_proj")
        if name not in self.expected:
            self.unexpected.append(key)
            return
        num_experts = self.expected[name].shape[0]
        if expert >= num_experts:
            raise MoeccError(f"checkpoint tensor {key} ({self.shard}) is for expert {expert}, but config.json gives "
                             f"{num_experts} experts per layer (0-{num_experts - 1}); the checkpoint does not "
                             "match its config.json")
        rows = slice(None)
        if part != "down":
            half = self.expected[name].shape[1] // 2
            rows = slice(0, half) if part == "gate" else slice(half, 2 * half)
        fused = self._fused(name)
        if tuple(fused[expert, rows].shape) != tuple(tensor.shape):
            raise MoeccError(f"checkpoint tensor {key} ({self.shard}) has shape {tuple(tensor.shape)}, the config "
                             f"implies {tuple(fused[expert, rows].shape)}; the checkpoint does not match its "
                             "config.json")
        self._claim(name, (expert, part), key)
        fused[expert, rows].copy_(tensor)

    def _check_expert_slices(self) -> None:
        """Every fused expert parameter is filled whole or by exactly one slice per (expert, part)."""
        for name, slices in self.expert_slices.items():
            if _WHOLE in slices:
                continue
            num_experts, parts = self.expected[name].shape[0], _parts_of(name)
            gaps = [f"{name.rpartition('.')[0]}.{e}.{_PART_KEY[p]}.weight"
                    for e in range(num_experts) for p in parts if (e, p) not in slices]
            if gaps:
                raise MoeccError(
                    f"checkpoint holds {len(slices)} of the {num_experts * len(parts)} expert slices of {name}; "
                    f"missing: {_listing(gaps)}. Those experts would hold uninitialised memory: copy the "
                    "complete checkpoint"
                )

    def finish(self) -> None:
        """Recomputes non-persistent buffers, ties weights and checks that nothing is left unloaded."""
        if self.unexpected:
            raise MoeccError(f"checkpoint has {len(self.unexpected)} tensors this {self.model.config.model_type} "
                             f"model has no place for (e.g. {self.unexpected[0]})")
        self._check_expert_slices()
        for name, module in list(self.model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding") and any(
                    b.device.type == "meta" for b in module.buffers()):
                parent_name, _, attr = name.rpartition(".")
                fresh = type(module)(config=self.model.config).to(self.device)
                setattr(self.model.get_submodule(parent_name), attr, fresh)
        self.model.tie_weights()
        missing = [n for n, t in list(self.model.named_parameters()) + list(self.model.named_buffers())
                   if t.device.type == "meta"]
        if missing:
            raise MoeccError(f"checkpoint is missing {len(missing)} tensors the model needs (e.g. {missing[0]})")


def _read_shard(shard: Path, filler: _ModelFiller) -> None:
    """Feeds every tensor of one safetensors shard to ``filler``; an unreadable file is named."""
    filler.shard = shard.name
    try:
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                filler.add(key, handle.get_tensor(key))
    except MoeccError:
        raise
    except Exception as error:  # SafetensorError, OSError: truncated, corrupted or unreadable
        raise MoeccError(f"checkpoint shard {str(shard)!r} cannot be read ({type(error).__name__}: {error}); it is "
                         "truncated or corrupted: copy it again from the original checkpoint") from error


def load_model(path: str | Path, dtype: str | torch.dtype, device: torch.device) -> torch.nn.Module:
    """The checkpoint's causal LM: experts in host memory, everything else on ``device``, in ``dtype`` (see
    :func:`resolve_dtype`: ``"auto"`` keeps the checkpoint's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = resolve_dtype(dtype, check_checkpoint(path))
    directory = Path(path)
    config = AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    filler = _ModelFiller(model, device, dtype)
    for shard in tqdm(_shard_files(directory), desc="loading shards", unit="shard"):
        _read_shard(shard, filler)
    filler.finish()
    return model.eval()
