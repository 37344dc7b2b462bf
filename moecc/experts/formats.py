"""Quantized formats of the frozen expert weights: one host copy in its format plus scales, and the rule that
turns it back into bf16.

Every format holds E matrices ``W [N, K]`` in the kernels' orientation (N outputs, K inputs: ``gate_up [E, 2I, H]``,
``down [E, H, I]``) whatever the model's own layout. A weight's bf16 value is defined once, here, and every
consumer (the CPU kernels' packing, the reference backend, the device-side dequantization) must produce these very
bits: ``bf16(float32(decoded) * float32(scale))``, one float32 product rounded to nearest even, no fused ops.

| format | ``data`` | ``scales`` | bytes a weight |
|---|---|---|---|
| ``int8`` | int8 ``[E, N, K]``, symmetric, ``round(w / s)`` in [-127, 127] | float32 ``[E, N]``: per output row | 1 + 4/K |
| ``int4`` | uint8 ``[E, N, K/2]``: two's-complement nibbles in [-7, 7], low nibble = even k | float32 ``[E, N, K/group]`` | 0.5 + 4/group |
| ``fp8`` | uint8 ``[E, N, K]``: ``float8_e4m3fn`` bits | float32 ``[E, ceil(N/128), ceil(K/128)]``: ``weight_scale_inv`` of 128 x 128 blocks | 1 + 4/16384 |
| ``mxfp4`` | uint8 ``[E, N, K/2]``: e2m1 nibbles (sign, then 3 bits indexing 0, .5, 1, 1.5, 2, 3, 4, 6), low nibble = even k | uint8 ``[E, N, K/32]``: e8m0, ``2^(s - 127)`` | 0.5 + 1/32 |

``fp8`` is DeepSeek-V3's and Qwen3-FP8's published convention, ``mxfp4`` gpt-oss's (``_blocks`` ``[E, N, K/32, 16]``
are ``data`` viewed 4-D); ``int8`` and ``int4`` are made from bf16 here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoeccError

FORMATS = ("int8", "int4", "fp8", "mxfp4")
INT4_GROUPS = (32, 64, 128)
FP8_BLOCK = 128
MXFP4_BLOCK = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# e2m1 magnitudes by their 3-bit code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class QuantizedMatrices:
    """E matrices ``[N, K]`` of one projection's experts in ``format`` (see the module docstring's table)."""

    format: str
    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int, int]  # (E, N, K)
    group: int  # the K (and, for fp8, N) extent one scale covers

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def experts(self, index: slice | int) -> QuantizedMatrices:
        """The matrices of experts ``index`` (views)."""
        data, scales = self.data[index], self.scales[index]
        if isinstance(index, int):
            data, scales = data.unsqueeze(0), scales.unsqueeze(0)
        return QuantizedMatrices(self.format, data, scales, (data.shape[0], *self.shape[1:]), self.group)


def check_format(format: str, k: int, group: int | None = None) -> int:
    """The scale group of ``format`` for matrices with ``k`` inputs, or an error naming what does not fit."""
    if format not in FORMATS:
        raise MoeccError(f"expert format {format!r} is not a quantized format; choose one of {', '.join(FORMATS)}")
    if format == "int4":
        group = 128 if group is None else group
        if group not in INT4_GROUPS:
            raise MoeccError(f"int4 group size {group} is not supported; choose one of {INT4_GROUPS}")
        if k % group:
            raise MoeccError(f"int4 group size {group} does not divide the experts' input size K={k}; choose a "
                             f"group size among {INT4_GROUPS} that divides it")
        return group
    if format == "mxfp4" and k % MXFP4_BLOCK:
        raise MoeccError(f"mxfp4 needs the experts' input size to be a multiple of {MXFP4_BLOCK}, got K={k}")
    return {"int8": k, "fp8": FP8_BLOCK, "mxfp4": MXFP4_BLOCK}[format]


def quantize(weights: torch.Tensor, format: str, group: int | None = None) -> QuantizedMatrices:
    """``weights [E, N, K]`` (any float dtype, host memory) in ``format``; ``group``: int4's group size along K."""
    if weights.dim() != 3:
        raise MoeccError(f"quantize takes expert weights [E, N, K], got shape {tuple(weights.shape)}")
    e, n, k = weights.shape
    group = check_format(format, k, group)
    w = weights.detach().float()
    if format == "int8":
        scales = _symmetric_scales(w.abs().amax(dim=2), 127.0)
        q = torch.clamp(torch.round(w / scales.unsqueeze(2)), -127, 127).to(torch.int8)
        return QuantizedMatrices(format, q.contiguous(), scales.contiguous(), (e, n, k), group)
    if format == "int4":
        blocks = w.view(e, n, k // group, group)
        scales = _symmetric_scales(blocks.abs().amax(dim=3), 7.0)
        q = torch.clamp(torch.round(blocks / scales.unsqueeze(3)), -7, 7).to(torch.int8).view(e, n, k)
        return QuantizedMatrices(format, _pack_nibbles(q), scales.contiguous(), (e, n, k), group)
    if format == "fp8":
        amax = _block_amax(w, FP8_BLOCK)
        scales = _symmetric_scales(amax, FP8_MAX)
        scaled = torch.clamp(w / _expand_blocks(scales, n, k, FP8_BLOCK), -FP8_MAX, FP8_MAX)
        q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return QuantizedMatrices(format, q.contiguous(), scales.contiguous(), (e, n, k), group)
    blocks = w.view(e, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=3)
    # The block's scale 2^(floor(log2 amax) - 2): e2m1's largest magnitude, 6, is 1.5 * 2^2. Kept within normal
    # float32 exponents (no subnormal scale), and 127 (a scale of 1) for an all-zero block.
    exponent = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0))) - 2,
                           torch.zeros_like(amax))
    scales = torch.clamp(exponent + 127, 1, 254).to(torch.uint8)
    scaled = blocks / e8m0_to_float(scales).unsqueeze(3)
    return QuantizedMatrices(format, _pack_nibbles(_to_e2m1(scaled.view(e, n, k))), scales.contiguous(), (e, n, k),
                             group)


def dequantize(q: QuantizedMatrices) -> torch.Tensor:
    """The bf16 matrices ``[E, N, K]`` of ``q``: ``bf16(float32(decoded) * float32(scale))`` element by element."""
    e, n, k = q.shape
    if q.format == "int8":
        return (q.data.float() * q.scales.unsqueeze(2)).to(torch.bfloat16)
    if q.format == "int4":
        values = _unpack_nibbles(q.data, k, signed=True).float()
        return (values * q.scales.repeat_interleave(q.group, dim=2)).to(torch.bfloat16)
    if q.format == "fp8":
        values = q.data.view(torch.float8_e4m3fn).float()
        return (values * _expand_blocks(q.scales, n, k, FP8_BLOCK)).to(torch.bfloat16)
    if q.format == "mxfp4":
        codes = _unpack_nibbles(q.data, k, signed=False).long()
        values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                              device=codes.device)[codes]
        return (values * e8m0_to_float(q.scales).repeat_interleave(MXFP4_BLOCK, dim=2)).to(torch.bfloat16)
    raise MoeccError(f"unknown expert format {q.format!r}")


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """``2^(s - 127)`` of e8m0 bytes as float32, from its bits (exact: no pow); 255 is NaN."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)  # 2^-127: the one subnormal
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def quantized_bytes(shape: tuple[int, int, int], format: str, group: int | None = None) -> int:
    """Bytes a ``format`` copy of matrices ``shape`` takes with its scales."""
    e, n, k = shape
    group = check_format(format, k, group)
    if format == "int8":
        return e * n * k + 4 * e * n
    if format == "int4":
        return e * n * k // 2 + 4 * e * n * (k // group)
    if format == "fp8":
        return e * n * k + 4 * e * -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
    return e * n * k // 2 + e * n * (k // MXFP4_BLOCK)


def _symmetric_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """float32 scales mapping ``amax`` to ``top`` (1 where a row or block is all zeros)."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax)).float()


def _block_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    """Largest magnitude of each ``block`` x ``block`` tile of ``w [E, N, K]`` (edge tiles ragged)."""
    e, n, k = w.shape
    padded = torch.zeros(e, -(-n // block) * block, -(-k // block) * block, dtype=w.dtype)
    padded[:, :n, :k] = w.abs()
    return padded.view(e, padded.shape[1] // block, block, padded.shape[2] // block, block).amax(dim=(2, 4))


def _expand_blocks(scales: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Block scales ``[E, ceil(N/b), ceil(K/b)]`` repeated to every weight ``[E, N, K]``."""
    return scales.repeat_interleave(block, dim=1)[:, :n].repeat_interleave(block, dim=2)[:, :, :k]


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[E, N, K]`` (the low 4 bits of each int8) two a byte, even k in the low nibble."""
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).contiguous()


def _unpack_nibbles(data: torch.Tensor, k: int, signed: bool) -> torch.Tensor:
    """The codes ``[E, N, K]`` of :func:`_pack_nibbles`'s bytes: int8, sign-extended where ``signed``."""
    low, high = (data & 0xF).to(torch.int8), (data >> 4).to(torch.int8)
    codes = torch.stack((low, high), dim=-1).view(*data.shape[:-1], k)
    return torch.where(codes > 7, codes - 16, codes) if signed else codes


def _to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (sign bit 3, magnitude index 0..7) nearest each value (ties to the even code), saturating."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    a = x.abs().clamp(max=E2M1_VALUES[-1])
    # The boundaries between neighbouring magnitudes; at a tie the even code (its lower bit 0) wins.
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    index = torch.bucketize(a, midpoints)  # a value at a midpoint goes to the lower code
    at_tie = (index < 7) & (a == midpoints[index.clamp(max=6)]) & (index % 2 == 1)
    index = torch.where(at_tie, index + 1, index)
    return (index + torch.where(x < 0, 8, 0)).to(torch.int8)
