"""Quantized checkpoints read into moecc's expert formats, shard by shard: FP8 with 128 x 128 block scales (as
DeepSeek-V3 and Qwen3-FP8 publish them) and MXFP4 (gpt-oss).

FP8 (``quantization_config.quant_method == "fp8"``): every ``float8_e4m3fn`` weight ``X.weight [out, in]`` comes with
``X.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``, ``W = w * scale_inv[i // 128, j // 128]``; modules
``modules_to_not_convert`` names are stored unquantized. Weights outside the routed experts (attention, dense and
shared MLPs) are dequantized to the model's dtype as soon as both halves are read (they may sit in different
shards). Routed experts, published per expert (``mlp.experts.<e>.gate_proj.weight`` + scale, up, down), are
assembled per layer in the kernels' orientation: ``gate_up [E, 2I, H]`` with gate rows before up rows, each part's
block scales kept apart until the layer is converted. Stacking them into one ``fp8`` gate_up is exact only when
``I`` is a multiple of 128 (then no 128-row block holds both gate and up rows): otherwise keeping the layer in
``fp8`` is refused, while ``bf16``, ``int8``, ``int4`` and ``mxfp4`` convert each part with its own scales.

MXFP4 (``quant_method == "mxfp4"``, gpt-oss): ``mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]`` and
``..._scales [E, 2I, H/32]`` (likewise ``down_proj``) are the ``mxfp4`` format's data (viewed 3-D) and scales as
they are, already in the kernels' orientation; the rest of the checkpoint is unquantized.

A layer is converted once all its pieces are read: kept (the checkpoint's format), dequantized (``bf16``) or
requantized from its bf16 values (another quantized format, asked for by name), so host memory holds the converted
layers plus the layers of the shard being read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .errors import MoeccError
from .experts.formats import FP8_BLOCK, MXFP4_BLOCK, QuantizedMatrices, dequantize

FP8_WEIGHT = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")
# Dtypes a block scale may be stored in, each exact in float32
WHOLE = "whole"  # a fused tensor given in one piece (the loader's claims)
SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, getattr(torch, "float8_e8m0fnu", None)) if d)
_RESTORE = ("Dequantize it once with transformers (its dequantize option), save it and load the bf16 copy")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's ``quantization_config`` says: its method and the modules it leaves unquantized."""

    method: str  # "fp8" or "mxfp4"
    not_converted: tuple[str, ...] = ()

    def converts(self, module_name: str) -> bool:
        """Whether ``module_name`` is quantized in the checkpoint, matching ``modules_to_not_convert`` as
        transformers does: a pattern from the start up to a module boundary (a regex), or a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{pattern}){boundary}", module_name) or module_name.endswith(pattern)
                       for pattern in self.not_converted)


def read_quantization(fields: dict) -> CheckpointQuantization | None:
    """The quantization a checkpoint's ``config.json`` fields declare (None: unquantized), or an error naming what
    moecc cannot read and how to get a copy it can."""
    config = fields.get("quantization_config")
    if not config:
        return None
    if not isinstance(config, dict):
        raise MoeccError(f"config.json's quantization_config is a {type(config).__name__}, not an object; copy the "
                         "file again from the original checkpoint")
    method = config.get("quant_method", "unknown")
    not_converted = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    if method == "fp8":
        block = config.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])  # transformers' default when absent
        if list(block or ()) != [FP8_BLOCK, FP8_BLOCK]:
            raise MoeccError(f"checkpoint is quantized (fp8) with weight_block_size={block!r}; moecc reads FP8 "
                             f"weights with 128 x 128 block scales ([128, 128], as DeepSeek-V3 and Qwen3-FP8 publish "
                             f"them). {_RESTORE}")
        if config.get("fmt", "e4m3") != "e4m3":
            raise MoeccError(f"checkpoint is quantized (fp8) as {config['fmt']!r}; moecc reads e4m3 weights. {_RESTORE}")
        if str(config.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise MoeccError(f"checkpoint is quantized (fp8) with activation_scheme={config['activation_scheme']!r} "
                             "(activation scales beside the weights); moecc reads weight-only FP8 with 'dynamic' "
                             f"activations. {_RESTORE}")
        return CheckpointQuantization("fp8", not_converted)
    if method == "mxfp4":
        if fields.get("model_type") != "gpt_oss":
            raise MoeccError(f"checkpoint is quantized (mxfp4) but is a {fields.get('model_type')!r} model; moecc "
                             "reads MXFP4 experts as gpt-oss publishes them (mlp.experts.*_blocks / *_scales). "
                             + _RESTORE)
        return CheckpointQuantization("mxfp4", not_converted)
    raise MoeccError(f"checkpoint is quantized ({method}); moecc reads FP8 (128 x 128 block scales) and MXFP4 (gpt-oss) "
                     f"checkpoints. {_RESTORE}")


def block_scale_shape(rows: int, columns: int) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of an FP8 weight ``[rows, columns]``."""
    return -(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK)


def check_scale(key: str, scale: torch.Tensor, expected: tuple[int, ...], shard: str) -> torch.Tensor:
    """``scale`` as float32 (a copy), after checking its dtype and shape against ``expected``."""
    if scale.dtype not in SCALE_DTYPES:
        raise MoeccError(f"checkpoint tensor {key} ({shard}) is {scale.dtype}; block scales are float32 (or bfloat16 "
                         "/ e8m0): the checkpoint is not the FP8 convention moecc reads (DeepSeek-V3 / Qwen3-FP8)")
    if tuple(scale.shape) != tuple(expected):
        raise MoeccError(f"checkpoint tensor {key} ({shard}) has shape {tuple(scale.shape)}, but its weight's 128 x 128 "
                         f"blocks need {tuple(expected)}: the scales do not match the weights (or weight_block_size); "
                         "copy the checkpoint again from the original")
    return scale.to(torch.float32, copy=True)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 values of one FP8 weight ``[out, in]`` with its float32 block scales (the formats' one rule)."""
    out, columns = weight.shape
    matrices = QuantizedMatrices("fp8", weight.view(torch.uint8).unsqueeze(0), scale.unsqueeze(0), (1, out, columns),
                                 FP8_BLOCK)
    return dequantize(matrices)[0]


@dataclass
class ExpertPieces:
    """One fused expert parameter's quantized pieces as the shards give them, in the kernels' orientation
    ``[E, N, K]``: FP8 ``data`` (e4m3 bits) with each part's (gate, up / down) block scales apart, or MXFP4 data and
    scales whole. ``parts`` splits N evenly."""

    format: str
    shape: tuple[int, int, int]
    parts: tuple[str, ...]
    data: torch.Tensor | None = None
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    scaled: dict = field(default_factory=dict)  # (expert, part) or part -> key that gave its scales

    @property
    def rows(self) -> int:
        return self.shape[1] // len(self.parts)

    def complete(self) -> bool:
        if self.format == "mxfp4":
            return self.data is not None and WHOLE in self.scaled
        return len(self.scaled) == self.shape[0] * len(self.parts)

    def missing_scales(self) -> list[str]:
        """The parts (``(expert, part)`` for FP8) whose scales no shard gave."""
        if self.format == "mxfp4":
            return [] if WHOLE in self.scaled else [WHOLE]
        return [f"{e}.{p}" for e in range(self.shape[0]) for p in self.parts if (e, p) not in self.scaled]

    def matrices(self) -> list[QuantizedMatrices]:
        """The pieces as matrices, one per part along N (views of ``data``)."""
        e, _, k = self.shape
        if self.format == "mxfp4":
            return [QuantizedMatrices("mxfp4", self.data, self.scales[WHOLE], self.shape, MXFP4_BLOCK)]
        rows = self.rows
        return [QuantizedMatrices("fp8", self.data[:, i * rows:(i + 1) * rows], self.scales[p], (e, rows, k), FP8_BLOCK)
                for i, p in enumerate(self.parts)]

    def stacked(self, name: str) -> QuantizedMatrices:
        """The pieces as one ``[E, N, K]`` matrices of their format: FP8 parts stack when each part's rows are
        whole 128-row blocks, else the error says why and what to load instead."""
        if self.format == "mxfp4" or len(self.parts) == 1:
            return self.matrices()[0]
        if self.rows % FP8_BLOCK:
            raise fp8_stacking_error(name, self.rows)
        return QuantizedMatrices("fp8", self.data, torch.cat([self.scales[p] for p in self.parts], dim=1),
                                 self.shape, FP8_BLOCK)


def fp8_stacking_error(name: str, rows: int) -> MoeccError:
    return MoeccError(
        f"{name}: the checkpoint's FP8 gate and up projections ({rows} rows each) carry their own 128-row block "
        f"scales, which one fused gate_up [E, {2 * rows}, H] in fp8 cannot hold: {rows} is not a multiple of 128, "
        "so one 128-row block would hold gate and up rows of different scales. Load it with expert_format='bf16' "
        "(the same values, dequantized: 2 bytes a weight) or 'int8' / 'int4' (requantized from those values)")


class QuantizedReader:
    """Takes a checkpoint's quantized tensors (and their scales) from the loader, which hands it every key first:
    pairs FP8 weights with their scales and hands them back dequantized, and gathers routed experts' pieces into
    :class:`ExpertPieces` for the loader to convert once a layer is complete."""

    def __init__(self, quantization: CheckpointQuantization) -> None:
        self.quantization = quantization
        self.pieces: dict[str, ExpertPieces] = {}  # fused expert parameter -> its pieces
        self._waiting: dict[str, dict] = {}  # FP8 weight key -> {"weight" / "scale": (tensor, shard)}
        self.quantized_tensors = 0  # quantized weights seen (a config that names a method must have some)

    def take(self, filler, key: str, tensor: torch.Tensor) -> bool:
        """Whether ``key`` is a quantized tensor or a scale, now held or placed (``filler``: the loader)."""
        if self.quantization.method == "mxfp4":
            return self._take_mxfp4(filler, key, tensor)
        if key.endswith(".weight" + SCALE_SUFFIX):
            weight_key, half = key[:-len(SCALE_SUFFIX)], "scale"
        elif tensor.dtype == FP8_WEIGHT:
            if not key.endswith(".weight"):
                raise MoeccError(f"checkpoint tensor {key} ({filler.shard}) is float8_e4m3fn; moecc reads FP8 weights "
                                 "named *.weight with a *.weight_scale_inv beside them (DeepSeek-V3 / Qwen3-FP8's "
                                 f"convention). {_RESTORE}")
            weight_key, half = key, "weight"
        else:
            return False
        module = weight_key.rpartition(".")[0]
        if half == "weight":
            self.quantized_tensors += 1
            if not self.quantization.converts(module):
                raise MoeccError(f"checkpoint tensor {key} ({filler.shard}) is float8_e4m3fn, but config.json's "
                                 f"modules_to_not_convert {list(self.quantization.not_converted)} lists {module} as "
                                 "unquantized: the config does not belong to these weights; copy the checkpoint again")
        piece = filler.expert_slice(weight_key)
        if piece is not None:
            self._take_expert_fp8(filler, key, piece, half, tensor)
        else:
            self._pair(filler, weight_key, half, tensor)
        return True

    def _pair(self, filler, weight_key: str, half: str, tensor: torch.Tensor) -> None:
        """Holds one half of a non-expert FP8 weight; with both, places the weight dequantized."""
        waiting = self._waiting.setdefault(weight_key, {})
        if half in waiting:
            raise MoeccError(f"checkpoint gives {weight_key}{'' if half == 'weight' else SCALE_SUFFIX} twice "
                             f"({waiting[half][1]} and {filler.shard}); the shards come from different saves, copy "
                             "the checkpoint again")
        waiting[half] = (tensor.clone(), filler.shard)  # a copy: the shard's file is closed after it is read
        if len(waiting) < 2:
            return
        del self._waiting[weight_key]
        weight, scale = waiting["weight"][0], waiting["scale"][0]
        if weight.dim() != 2:
            raise MoeccError(f"checkpoint tensor {weight_key} is float8_e4m3fn of shape {tuple(weight.shape)}; FP8 "
                             "weights with block scales are matrices [out, in]")
        scale = check_scale(weight_key + SCALE_SUFFIX, scale, block_scale_shape(*weight.shape), filler.shard)
        filler.add(weight_key, dequantize_fp8(weight, scale))

    def _take_expert_fp8(self, filler, key: str, piece, half: str, tensor: torch.Tensor) -> None:
        name, expert, part, rows = piece
        e, n, k = filler.kernel_shape(name)
        parts = ("down",) if part == "down" else ("gate", "up")
        pieces = self.pieces.setdefault(name, ExpertPieces("fp8", (e, n, k), parts))
        part_rows = n // len(parts)
        if half == "weight":
            if tuple(tensor.shape) != (part_rows, k):
                raise MoeccError(f"checkpoint tensor {key} ({filler.shard}) has shape {tuple(tensor.shape)}, the "
                                 f"config implies {(part_rows, k)}; the checkpoint does not match its config.json")
            filler.claim(name, (expert, part), key)
            if pieces.data is None:
                pieces.data = torch.empty((e, n, k), dtype=torch.uint8)
            pieces.data[expert, rows].copy_(tensor.view(torch.uint8))
            return
        if (expert, part) in pieces.scaled:
            raise MoeccError(f"checkpoint gives {key} twice ({pieces.scaled[(expert, part)]} and {filler.shard}); the "
                             "shards come from different saves, copy the checkpoint again")
        scale_shape = block_scale_shape(part_rows, k)
        if part not in pieces.scales:
            pieces.scales[part] = torch.empty((e, *scale_shape), dtype=torch.float32)
        pieces.scales[part][expert] = check_scale(key, tensor, scale_shape, filler.shard)
        pieces.scaled[(expert, part)] = filler.shard

    def _take_mxfp4(self, filler, key: str, tensor: torch.Tensor) -> bool:
        name, _, suffix = key.rpartition("_")
        suffix = "_" + suffix
        if suffix not in MXFP4_SUFFIXES or ".experts." not in name or name not in filler.expected:
            return False
        e, n, k = filler.kernel_shape(name)
        blocks = k // MXFP4_BLOCK
        expected = (e, n, blocks, 16) if suffix == "_blocks" else (e, n, blocks)
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != expected:
            raise MoeccError(f"checkpoint tensor {key} ({filler.shard}) is {tensor.dtype} {tuple(tensor.shape)}; "
                             f"gpt-oss's MXFP4 {suffix[1:]} for these experts are uint8 {expected}: the checkpoint "
                             "does not match its config.json")
        pieces = self.pieces.setdefault(name, ExpertPieces("mxfp4", (e, n, k), (WHOLE,)))
        if suffix == "_blocks":
            self.quantized_tensors += 1
            filler.claim(name, WHOLE, key)
            pieces.data = tensor.reshape(e, n, k // 2).clone()
        else:
            if WHOLE in pieces.scaled:
                raise MoeccError(f"checkpoint gives {key} twice ({pieces.scaled['whole']} and {filler.shard}); the "
                                 "shards come from different saves, copy the checkpoint again")
            pieces.scales[WHOLE] = tensor.clone()
            pieces.scaled[WHOLE] = filler.shard
        return True

    def finish(self) -> None:
        """Refuses what the shards left half-given: a weight without its scales or scales without a weight, and a
        config that declares a quantization no tensor has."""
        for weight_key, waiting in self._waiting.items():
            (half, (_, shard)), = waiting.items()
            if half == "weight":
                raise MoeccError(f"checkpoint tensor {weight_key} ({shard}) is float8_e4m3fn, but no shard holds its "
                                 f"block scales {weight_key}{SCALE_SUFFIX}: copy the complete checkpoint")
            raise MoeccError(f"checkpoint tensor {weight_key}{SCALE_SUFFIX} ({shard}) scales a weight {weight_key} "
                             "that no shard holds: copy the complete checkpoint")
        for name, pieces in self.pieces.items():
            missing = pieces.missing_scales()
            if pieces.data is not None and missing:
                raise MoeccError(f"checkpoint holds {name}'s quantized weights without the scales of "
                                 f"{', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''}: copy the "
                                 "complete checkpoint")
            if pieces.data is None:
                raise MoeccError(f"checkpoint holds scales of {name} but not its quantized weights: copy the "
                                 "complete checkpoint")
        if not self.quantized_tensors:
            method = self.quantization.method
            raise MoeccError(f"config.json says the checkpoint is quantized ({method}), but none of its tensors is: "
                             "the config does not belong to these weights (if they were dequantized, remove "
                             "quantization_config from config.json)")
