"""The quantized expert formats: their bf16 values against an element-by-element decoding, their layouts as
published (fp8 block scales, gpt-oss's MXFP4 blocks), their errors on real-looking weights and their refusals."""
from __future__ import annotations

import math

import pytest
import torch

from moecc.errors import MoeccError
from moecc.experts.formats import (E2M1_VALUES, QuantizedMatrices, dequantize, e8m0_to_float, quantize,
                                   quantized_bytes)

CASES = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", None), ("mxfp4", None)]


def _bf16(value: float) -> float:
    """``value`` (a float32) rounded to bf16, back as a float."""
    return torch.tensor(value, dtype=torch.float32).to(torch.bfloat16).item()


def _slow_dequantize(q: QuantizedMatrices) -> torch.Tensor:
    """One weight at a time from the format's definition, with scalar float32 arithmetic."""
    e_count, n_count, k_count = q.shape
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    for e in range(e_count):
        for n in range(n_count):
            for k in range(k_count):
                if q.format == "int8":
                    value, scale = int(q.data[e, n, k]), q.scales[e, n].item()
                elif q.format in ("int4", "mxfp4"):
                    byte = int(q.data[e, n, k // 2])
                    code = (byte >> 4) if k % 2 else (byte & 0xF)
                    if q.format == "int4":
                        value, scale = code - 16 if code > 7 else code, q.scales[e, n, k // q.group].item()
                    else:
                        magnitude = E2M1_VALUES[code & 7]
                        value = -magnitude if code & 8 else magnitude
                        scale = math.ldexp(1.0, int(q.scales[e, n, k // 32]) - 127)
                else:
                    value = q.data[e, n, k].view(torch.float8_e4m3fn).float().item()
                    scale = q.scales[e, n // 128, k // 128].item()
                product = torch.tensor(value, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
                out[e, n, k] = _bf16(product.item())
    return out


@pytest.mark.parametrize("format, group", CASES)
def test_dequantized_values_follow_the_formats_definition_bit_for_bit(format, group):
    torch.manual_seed(0)
    shape = (2, 5, 256) if format != "fp8" else (2, 130, 136)  # fp8: ragged 128 x 128 blocks at both edges
    w = torch.randn(shape) * 0.05
    q = quantize(w, format, group)
    got = dequantize(q)
    assert got.dtype == torch.bfloat16 and got.shape == shape
    if format == "fp8":  # the slow decoding on the blocks' corners (a full loop over 35k weights is slow)
        corner = QuantizedMatrices(format, q.data[:, 120:130, 120:136], q.scales[:, :, :], (2, 10, 16), 128)
        slow = torch.empty(2, 10, 16, dtype=torch.bfloat16)
        for e in range(2):
            for n in range(10):
                for k in range(16):
                    value = corner.data[e, n, k].view(torch.float8_e4m3fn).float()
                    slow[e, n, k] = (value * q.scales[e, (120 + n) // 128, (120 + k) // 128]).to(torch.bfloat16)
        assert torch.equal(got[:, 120:130, 120:136].view(torch.int16), slow.view(torch.int16))
    else:
        assert torch.equal(got.view(torch.int16), _slow_dequantize(q).view(torch.int16))


@pytest.mark.parametrize("format, group, bound", [("int8", None, 0.01), ("int4", 32, 0.12), ("int4", 128, 0.14),
                                                  ("fp8", None, 0.04), ("mxfp4", None, 0.15)])
def test_weight_error_of_each_format_on_gaussian_weights(format, group, bound):
    torch.manual_seed(1)
    w = (torch.randn(4, 64, 512) * 0.02).to(torch.bfloat16)
    error = (dequantize(quantize(w, format, group)).float() - w.float()).norm() / w.float().norm()
    assert 0 < error < bound


@pytest.mark.parametrize("format, group", CASES)
def test_sizes_and_zero_rows(format, group):
    w = torch.randn(3, 32, 256)
    w[1] = 0.0  # an all-zero expert: scales stay finite, values zero
    q = quantize(w, format, group)
    assert q.nbytes == quantized_bytes(tuple(w.shape), format, group) < w.to(torch.bfloat16).nbytes
    assert torch.isfinite(q.scales.float()).all()
    assert torch.equal(dequantize(q)[1].float(), torch.zeros(32, 256))
    one = q.experts(2)
    assert one.shape == (1, 32, 256) and torch.equal(dequantize(one)[0], dequantize(q)[2])


def test_nibbles_hold_the_even_input_in_the_low_half():
    w = torch.zeros(1, 1, 64)
    w[0, 0, 0], w[0, 0, 1] = 7.0, -1.0  # int4 with one group: scale 1, codes 7 and -1 (0xF)
    q = quantize(w, "int4", 64)
    assert q.scales.item() == 1.0 and int(q.data[0, 0, 0]) == 0xF7


def test_mxfp4_blocks_are_gpt_oss_layout_and_e8m0_scales_are_exact():
    w = torch.zeros(1, 2, 64)
    w[0, 0, :32] = torch.tensor(E2M1_VALUES * 4) * 4.0  # amax 24 = 1.5 * 2^4: scale 2^(4 - 2) = 4
    q = quantize(w, "mxfp4")
    assert q.data.view(1, 2, 2, 16).shape == (1, 2, 2, 16)  # gpt-oss's _blocks: [E, N, K/32, 16]
    assert int(q.scales[0, 0, 0]) == 127 + 2 and torch.equal(dequantize(q).float(), w)
    scales = e8m0_to_float(torch.tensor([127, 128, 1, 0, 254, 255], dtype=torch.uint8)).tolist()
    assert scales[:5] == [1.0, 2.0, 2.0 ** -126, 2.0 ** -127, 2.0 ** 127] and math.isnan(scales[5])


def test_e2m1_rounds_ties_to_the_even_code_and_saturates():
    w = torch.zeros(1, 1, 32)
    # with the scale 1 (amax 6): 0.25 -> 0 (even), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2), 2.5 -> 2.0, 5 -> 4
    w[0, 0, :6] = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 6.0])
    q = quantize(w, "mxfp4")
    assert dequantize(q)[0, 0, :6].tolist() == [0.0, 1.0, 1.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("format, group, shape, message", [
    ("int4", 48, (1, 4, 96), "int4 group size 48 is not supported"),
    ("int4", 128, (1, 4, 192), "does not divide the experts' input size K=192"),
    ("mxfp4", None, (1, 4, 48), "multiple of 32, got K=48"),
    ("int3", None, (1, 4, 64), "'int3' is not a quantized format"),
])
def test_formats_refuse_what_does_not_fit(format, group, shape, message):
    with pytest.raises(MoeccError, match=message):
        quantize(torch.randn(shape), format, group)
