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

Experts are held in ``MoeccConfig.expert_format``: a layer's two fused parameters are converted as soon as the
shard that completes them has been read (quantized, dequantized or kept), so host memory holds the converted
layers plus the layers of one shard. FP8 (128 x 128 block scales) and MXFP4 (gpt-oss) checkpoints are read by
:mod:`moecc.quantized_loading`; other quantized checkpoints are refused with a message. Every tensor is copied
out of its shard, so no shard's file stays mapped once it has been read.
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .config import QUANTIZED_FORMATS
from .errors import MoeccError, UnsupportedDtypeError, UnsupportedModelError
from .experts.formats import check_format
from .models import FAMILIES
from .quantized_loading import WHOLE as _WHOLE
from .quantized_loading import CheckpointQuantization, ExpertPieces, QuantizedReader, fp8_stacking_error, read_quantization
from .store import convert, dequantize_into, hold_quantized, kernel_shape, kernel_view, return_freed_memory

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
    read_quantization(fields)  # refuses a quantization moecc cannot read
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


def _parts_of(name: str) -> tuple[str, ...]:
    return ("gate", "up") if name.endswith("gate_up_proj") else ("down",)


def _listing(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class _ModelFiller:
    """Materialises a meta-device model tensor by tensor: experts into host memory, the rest onto ``device``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, expert_format: str = "auto",
                 int4_group_size: int | None = None, quantization: CheckpointQuantization | None = None) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.expert_format, self.int4_group_size = expert_format, int4_group_size
        self.reader = QuantizedReader(quantization) if quantization is not None else None
        self.converted: set[str] = set()  # fused expert parameters in their final format
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
        # The model's own dtype for each tensor (``dtype``, or float32 where the family keeps one, as DeepSeek-V3's
        # router); a copy even where no conversion is needed: a view would keep the shard's file mapped
        dtype = target.dtype if tensor.is_floating_point() and target.is_floating_point() else tensor.dtype
        value = tensor.to(device=device, dtype=dtype, copy=True)
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

    def claim(self, name: str, piece, key: str) -> None:
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

    def kernel_shape(self, name: str) -> tuple[int, int, int]:
        """``(E, N, K)`` of the fused expert parameter ``name`` in the kernels' orientation."""
        return kernel_shape(self.model.get_submodule(name.rpartition(".")[0]), self.expected[name].shape)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        key = key.replace(".block_sparse_moe.", ".mlp.")
        if self.reader is not None and self.reader.take(self, key, tensor):
            return
        if key in self.expected:
            is_expert = ".experts." in key
            if is_expert:
                self.claim(key, _WHOLE, key)
            elif key in self.seen:
                raise MoeccError(f"checkpoint tensor {key} is in both {self.seen[key]} and {self.shard}; the shards "
                                 "come from different saves, copy the checkpoint again")
            else:
                self.seen[key] = self.shard
            self._place(key, tensor, torch.device("cpu") if is_expert else self.device)
            return
        piece = self.expert_slice(key)
        if piece is None:
            if not key.endswith("rotary_emb.inv_freq"):
                self.unexpected.append(key)
            return
        self._add_expert_slice(key, piece, tensor)

    def expert_slice(self, key: str) -> tuple[str, int, str, slice] | None:
        """``(fused parameter, expert, part, rows)`` a per-expert key fills, None for a key of another kind."""
        match = _PER_EXPERT.match(key.replace(".block_sparse_moe.", ".mlp."))
        if match is None:
            return None
        experts, expert, part = match["prefix"] + ".mlp.experts", int(match["expert"]), _PART[match["part"]]
        name = experts + (".down_proj" if part == "down" else ".gate_up_proj")
        if name not in self.expected:
            return None
        num_experts = self.expected[name].shape[0]
        if expert >= num_experts:
            raise MoeccError(f"checkpoint tensor {key} ({self.shard}) is for expert {expert}, but config.json gives "
                             f"{num_experts} experts per layer (0-{num_experts - 1}); the checkpoint does not "
                             "match its config.json")
        _, n, _ = self.kernel_shape(name)
        rows = slice(None)
        if part != "down":
            rows = slice(0, n // 2) if part == "gate" else slice(n // 2, n)
        return name, expert, part, rows

    def _add_expert_slice(self, key: str, piece: tuple, tensor: torch.Tensor) -> None:
        name, expert, part, rows = piece
        fused = kernel_view(self.model.get_submodule(name.rpartition(".")[0]), self._fused(name))
        if tuple(fused[expert, rows].shape) != tuple(tensor.shape):
            raise MoeccError(f"checkpoint tensor {key} ({self.shard}) has shape {tuple(tensor.shape)}, the config "
                             f"implies {tuple(fused[expert, rows].shape)}; the checkpoint does not match its "
                             "config.json")
        self.claim(name, (expert, part), key)
        fused[expert, rows].copy_(tensor)

    def _complete(self, name: str) -> bool:
        """Whether every slice of the fused expert parameter ``name`` (and its scales) has been read."""
        slices = self.expert_slices.get(name, {})
        pieces = self.reader.pieces.get(name) if self.reader is not None else None
        whole = _WHOLE in slices or len(slices) == self.expected[name].shape[0] * len(_parts_of(name))
        return whole and (pieces is None or pieces.complete())

    def convert_complete(self) -> None:
        """Puts every fused expert parameter read in full into its final format (``expert_format``)."""
        for name in list(self.expert_slices):
            fused = name.endswith((".experts.gate_up_proj", ".experts.down_proj"))  # not the biases
            if fused and name not in self.converted and self._complete(name):
                self.converted.add(name)
                pieces = self.reader.pieces.pop(name, None) if self.reader is not None else None
                self._convert(name, pieces)

    def _convert(self, name: str, pieces: ExpertPieces | None) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        source = pieces.format if pieces is not None else None
        target = {"auto": source, "bf16": None}.get(self.expert_format, self.expert_format)
        if pieces is not None and module._parameters[attr].device.type != "meta":
            raise MoeccError(f"checkpoint gives the experts of {name} partly quantized ({source}) and partly "
                             "unquantized; moecc holds a layer's experts in one format: copy the checkpoint again")
        if pieces is None:
            if target is not None:  # unquantized weights, held quantized from here on
                weights = module._parameters[attr].data
                hold_quantized(module, attr, convert(kernel_view(module, weights), target, self.int4_group_size),
                               self.dtype)
        elif target == source:
            hold_quantized(module, attr, pieces.stacked(name), self.dtype)
        elif target is None:
            dequantize_into(kernel_view(module, self._fused(name)), pieces.matrices())
        else:
            hold_quantized(module, attr, convert(pieces.matrices(), target, self.int4_group_size), self.dtype)

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
        if self.reader is not None:
            self.reader.finish()
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
    with _reading(shard):
        handle = safe_open(str(shard), framework="pt")
    with handle:
        for key in handle.keys():
            with _reading(shard):
                tensor = handle.get_tensor(key)
            filler.add(key, tensor)  # its errors are the loader's own, not the file's


@contextlib.contextmanager
def _reading(shard: Path):
    """Names ``shard`` in the error of a read that fails (SafetensorError, OSError: truncated, corrupted or
    unreadable)."""
    try:
        yield
    except Exception as error:
        raise MoeccError(f"checkpoint shard {str(shard)!r} cannot be read ({type(error).__name__}: {error}); it is "
                         "truncated or corrupted: copy it again from the original checkpoint") from error


def checkpoint_format(path: str | Path) -> str | None:
    """The quantized format a checkpoint directory's experts are stored in (``"fp8"``, ``"mxfp4"``), or None."""
    quantization = read_quantization(check_checkpoint(path))
    return quantization.method if quantization is not None else None


def _check_dtype(quantization: CheckpointQuantization | None, expert_format: str, dtype: torch.dtype) -> None:
    """Quantized experts, and ``expert_format="bf16"``, need a bfloat16 model."""
    if dtype == torch.bfloat16 or (expert_format == "auto" and quantization is None):
        return
    name = str(dtype).removeprefix("torch.")
    if quantization is not None:
        raise UnsupportedDtypeError(
            f"checkpoint is quantized ({quantization.method}) and dtype={name!r} was asked for, but experts read from "
            "a quantized checkpoint compute in bfloat16: load it with dtype=torch.bfloat16 (or dequantize it once "
            f"to {name} with transformers and load that copy)")
    raise UnsupportedDtypeError(
        f"expert_format={expert_format!r} holds bfloat16 experts{'' if expert_format == 'bf16' else ' quantized'}, but "
        f"dtype={name!r} was asked for: load with dtype=torch.bfloat16, or use expert_format='auto' for {name} experts")


def _check_expert_formats(filler: _ModelFiller, quantization: CheckpointQuantization | None) -> None:
    """Before any weight is read: every routed experts' parameter can be held in the format asked for."""
    requested = filler.expert_format
    for name, tensor in filler.expected.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")) or tensor.dim() != 3:
            continue
        _, n, k = filler.kernel_shape(name)
        if requested in QUANTIZED_FORMATS:
            try:
                check_format(requested, k, filler.int4_group_size)
            except MoeccError as error:
                where = " (MoeccConfig(int4_group_size=...) or MOECC_INT4_GROUP)" if requested == "int4" else ""
                raise MoeccError(f"{name}: {error}{where}") from None
        keeps_fp8 = quantization is not None and quantization.method == "fp8" and requested in ("auto", "fp8")
        if keeps_fp8 and name.endswith("gate_up_proj") and (n // 2) % 128:
            raise fp8_stacking_error(name, n // 2)


def load_model(path: str | Path, dtype: str | torch.dtype, device: torch.device, expert_format: str = "auto",
               int4_group_size: int | None = None) -> torch.nn.Module:
    """The checkpoint's causal LM: experts in host memory in ``expert_format`` (``MoeccConfig.expert_format``;
    ``int4_group_size`` for int4), everything else on ``device``, in ``dtype`` (see :func:`resolve_dtype`:
    ``"auto"`` keeps the checkpoint's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = check_checkpoint(path)
    quantization = read_quantization(fields)
    dtype = resolve_dtype(dtype, fields)
    _check_dtype(quantization, expert_format, dtype)
    directory = Path(path)
    config = AutoConfig.from_pretrained(str(directory))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # moecc holds the experts' formats itself: transformers' is not involved
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    filler = _ModelFiller(model, device, dtype, expert_format, int4_group_size, quantization)
    _check_expert_formats(filler, quantization)
    for shard in tqdm(_shard_files(directory), desc="loading shards", unit="shard"):
        _read_shard(shard, filler)
        filler.convert_complete()
    filler.finish()
    if filler.converted and (quantization is not None or expert_format != "auto"):
        return_freed_memory()
    return model.eval()
