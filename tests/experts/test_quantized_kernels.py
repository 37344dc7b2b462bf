"""Quantized frozen experts on the CPU: the kernels' pack-time dequantization against ``formats.dequantize`` bit for
bit, the native kernels on quantized weights against the reference on the same weights (bf16 tolerance) and against
themselves on those weights' bf16 values (bit for bit), whole layers and expert subsets, and the refusals."""
from __future__ import annotations

import types

import pytest
import torch

from moecc import _ops
from moecc.errors import MoeccError
from moecc.experts import reference
from moecc.experts.formats import QuantizedMatrices, dequantize, quantize
from moecc.experts.native import NativeExperts
from moecc.experts.select import PerLayerExperts
from moecc.experts.types import ExpertLora, ExpertWeights

from ..parity import rel_err

ISAS = _ops.hardware_isas()
GRAD_NAMES = ("gate_up_A", "gate_up_B", "down_A", "down_B")


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 tensors equal bit for bit, NaN matching any NaN (torch and the kernels write different NaN bits)."""
    nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
    return bool(torch.equal(nan_got, nan_want)
                and torch.equal(got.view(torch.int16)[~nan_got], want.view(torch.int16)[~nan_want]))


def _random_codes(format: str, group: int | None, shape: tuple[int, int, int], seed: int) -> QuantizedMatrices:
    """Every code of the format (fp8 NaNs and subnormals, int4's -8, mxfp4's -0) and scales from tiny (denormal
    products) to large; e8m0 scales of every byte, 0 (2^-127) and 255 (NaN) included."""
    g = torch.Generator().manual_seed(seed)
    layout = quantize(torch.zeros(shape), format, group)
    data = torch.randint(0, 256, tuple(layout.data.shape), generator=g, dtype=torch.uint8)
    if format == "int8":
        data = data.view(torch.int8)
    if format == "mxfp4":
        scales = torch.randint(0, 256, tuple(layout.scales.shape), generator=g, dtype=torch.uint8)
    else:
        exponents = torch.randint(-140, 20, tuple(layout.scales.shape), generator=g).float()
        scales = torch.rand(tuple(layout.scales.shape), generator=g) * torch.exp2(exponents)
    return QuantizedMatrices(format, data, scales, shape, layout.group)


DEQUANTIZE_CASES = [  # format, group, (E, N, K)
    ("int8", None, (2, 37, 53)),     # K % 16 != 0: a ragged last chunk
    ("int8", None, (1, 16, 16)),
    ("int4", 32, (2, 21, 96)),
    ("int4", 64, (2, 9, 192)),
    ("int4", 128, (2, 5, 384)),
    ("fp8", None, (2, 130, 200)),    # ragged 128 x 128 blocks at both edges; K % 16 != 0
    ("fp8", None, (1, 300, 136)),
    ("mxfp4", None, (2, 21, 96)),
]


@pytest.mark.parametrize("format, group, shape", DEQUANTIZE_CASES,
                         ids=[f"{c[0]}{c[1] or ''}-{'x'.join(map(str, c[2]))}" for c in DEQUANTIZE_CASES])
def test_pack_time_dequantization_matches_formats_bit_for_bit(format, group, shape):
    """The blocks the product tasks dequantize (a forward task's rows, all K; an input-gradient task's columns,
    all N; starts on and off 16-column chunks) are formats.dequantize's bits."""
    _, n, k = shape
    for seed, quantized in enumerate((_random_codes(format, group, shape, 0),
                                      quantize(torch.randn(shape) * 0.05, format, group))):
        full = dequantize(quantized)
        for expert in range(shape[0]):
            for rows, cols in (((0, n), (0, k)), ((0, min(n, 16)), (0, k)), ((n // 3, n), (0, k)),
                               ((0, n), (16, min(k, 48))), ((0, n), (5, k - 3)), ((0, n), (k - 1, k)),
                               ((2, 2), (0, k))):
                got = _ops.dequantize_block_test(quantized, expert, rows, cols)
                want = full[expert, rows[0]:rows[1], cols[0]:cols[1]]
                assert _same_bits(got, want), (seed, expert, rows, cols)


def _placeholder(shape: torch.Size) -> torch.Tensor:
    """A weight tensor of the model's shape and dtype holding no values; NaN, should anything read it."""
    return torch.full((), float("nan"), dtype=torch.bfloat16).expand(shape)


def _problem(format, group, tokens, experts, hidden, inter, top_k, rank, seed):
    """Quantized experts (and the same values as bf16 tensors), routing in which expert 0 is hot, expert 1 gets
    exactly one pair and the last expert none, LoRA of ``rank`` (0: none) on both projections."""
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, format, group)
    down = quantize(torch.randn(experts, hidden, inter, generator=g) * 0.1, format, group)
    quantized = ExpertWeights(_placeholder((experts, 2 * inter, hidden)), _placeholder((experts, hidden, inter)),
                              gate_up_q=gate_up, down_q=down)
    plain = ExpertWeights(dequantize(gate_up), dequantize(down))
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 0] += 2.0
    scores[:, 1] = -2.0
    scores[:, experts - 1] = -1.0
    index = scores.topk(top_k, dim=1).indices
    if tokens:
        index[0, -1] = 1
    loras = [None if rank == 0 else
             ExpertLora(torch.randn(rank * experts, n_in, generator=g) * 0.1,
                        torch.randn(n_out, rank * experts, generator=g) * 0.1, 1.5, experts)
             for n_in, n_out in ((hidden, 2 * inter), (inter, hidden))]
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = torch.rand(tokens, top_k, generator=g)
    grad_out = torch.randn(tokens, hidden, generator=g)
    return quantized, plain, (x, index, w, *loras), grad_out


def _run(backend, weights, inputs, grad_out, **subset):
    out, saved = backend.forward(weights, *inputs, **subset)
    grad_hidden, grad_w, grads = backend.backward(weights, saved, grad_out, *inputs[3:])
    lora = [getattr(grads, name) for name in GRAD_NAMES if getattr(grads, name) is not None]
    return [out, grad_hidden, grad_w, *lora]


CASES = [  # format, group, tokens, experts, hidden, inter, top_k, rank
    ("int8", None, 37, 6, 48, 40, 2, 4),     # H and I not multiples of 32; I % 16 != 0
    ("int8", None, 0, 4, 32, 16, 2, 2),
    ("int4", 32, 40, 5, 64, 96, 2, 4),
    ("int4", 64, 30, 5, 128, 64, 2, 0),
    ("int4", 128, 20, 4, 256, 128, 2, 2),
    ("fp8", None, 40, 5, 136, 72, 2, 4),     # N and K not multiples of 128 in both projections
    ("fp8", None, 12, 4, 200, 150, 2, 0),    # H % 16 != 0; 2I = 300 spans three row blocks
    ("mxfp4", None, 37, 6, 64, 96, 3, 4),
    ("mxfp4", None, 1, 4, 32, 64, 2, 1),
]
CASE_IDS = [f"{c[0]}{c[1] or ''}-T{c[2]}-E{c[3]}-H{c[4]}-I{c[5]}-r{c[7]}" for c in CASES]


def _float32_autograd(weights, inputs, grad_out):
    """The reference's float32 function differentiated by torch: out, and the gradients of the hidden states,
    routing weights and LoRA factors."""
    x, index, w, *loras = inputs
    x, w = x.float().requires_grad_(), w.clone().requires_grad_()
    loras = [None if lora is None else ExpertLora(lora.A.clone().requires_grad_(), lora.B.clone().requires_grad_(),
                                                  lora.scaling, lora.num_experts) for lora in loras]
    out = reference.autograd(weights, x, index, w, *loras)
    factors = [t for lora in loras if lora is not None for t in (lora.A, lora.B)]
    if x.numel() == 0:
        return [out, torch.zeros_like(x), torch.zeros_like(w)] + [torch.zeros_like(t) for t in factors]
    grads = torch.autograd.grad(out, [x, w, *factors], grad_out, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [x, w, *factors])]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_native_on_quantized_weights_matches_reference(isa, case):
    """Against the reference's bf16 pipeline (output, input and routing-weight gradients) and against its float32
    function differentiated by torch (all of them): the pipeline rounds a one-pair expert's LoRA gradients in bf16
    a few times (3% off float32 here), where the kernels keep them in float32."""
    quantized, _, inputs, grad_out = _problem(*case, seed=case[2])
    got = _run(NativeExperts(isa), quantized, inputs, grad_out)
    assert got[0].shape == (case[2], case[4]) and got[0].dtype == torch.bfloat16
    pipeline = _run(reference, quantized, inputs, grad_out)
    exact = _float32_autograd(quantized, inputs, grad_out)
    for name, a, b, c in zip(("out", "grad_hidden", "grad_weights", *GRAD_NAMES), got, pipeline, exact):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, c) <= 2e-2, name
        assert name in GRAD_NAMES or rel_err(a, b) <= 2e-2, name


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES[::2], ids=CASE_IDS[::2])
def test_native_on_quantized_weights_equals_native_on_their_bf16_values(isa, case):
    """The products read the very bf16 values a dequantized copy holds: results agree bit for bit, for each
    projection quantized alone too."""
    quantized, plain, inputs, grad_out = _problem(*case, seed=case[2] + 1)
    want = _run(NativeExperts(isa), plain, inputs, grad_out)
    mixed = ExpertWeights(quantized.gate_up, plain.down, gate_up_q=quantized.gate_up_q)
    for weights in (quantized, mixed):
        for a, b in zip(_run(NativeExperts(isa), weights, inputs, grad_out), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format, group", [("int8", None), ("int4", 32), ("fp8", None), ("mxfp4", None)])
def test_native_subsets_of_quantized_experts(isa, format, group):
    """Expert subsets (hybrid's CPU part) on quantized weights: the reference's subset to bf16 tolerance, the bf16
    values' subset bit for bit, and the rows per pair of forward_pairs likewise."""
    quantized, plain, inputs, grad_out = _problem(format, group, 30, 6, 64, 32, 2, 2, seed=3)
    for mask in (torch.tensor([True, True, False, False, True, False]), torch.tensor([False, True] + [False] * 4)):
        got = _run(NativeExperts(isa), quantized, inputs, grad_out, expert_mask=mask)
        for a, b in zip(got, _run(reference, quantized, inputs, grad_out, expert_mask=mask)):
            assert rel_err(a, b) <= 2e-2
        for a, b in zip(got, _run(NativeExperts(isa), plain, inputs, grad_out, expert_mask=mask)):
            assert torch.equal(a, b)
        rows, tokens, _ = NativeExperts(isa).forward_pairs(quantized, *inputs, expert_mask=mask)
        want_rows, want_tokens, _ = NativeExperts(isa).forward_pairs(plain, *inputs, expert_mask=mask)
        assert torch.equal(rows, want_rows) and (tokens is None) == (want_tokens is None)


@pytest.mark.parametrize("layout", ["default", "gpt_oss"])
@pytest.mark.parametrize("format, group", [("int8", None), ("int4", 64), ("fp8", None), ("mxfp4", None)])
def test_reference_on_quantized_weights_equals_reference_on_their_bf16_values(format, group, layout):
    """The oracle dequantizes each expert as it reaches it, transposed into the model's layout (gpt-oss stores
    [E, in, out]; QuantizedMatrices are [E, out, in] always): the same bits as the bf16 values in place."""
    quantized, plain, inputs, grad_out = _problem(format, group, 13, 5, 64, 64, 2, 2, seed=4)
    if layout == "gpt_oss":
        g = torch.Generator().manual_seed(5)
        extra = dict(gate_up_bias=torch.randn(5, 128, generator=g).bfloat16() * 0.1,
                     down_bias=torch.randn(5, 64, generator=g).bfloat16() * 0.1, transposed=True, interleaved=True,
                     swiglu_alpha=1.702, swiglu_limit=0.5)
        plain = ExpertWeights(plain.gate_up.transpose(1, 2).contiguous(), plain.down.transpose(1, 2).contiguous(),
                              **extra)
        quantized = ExpertWeights(_placeholder(plain.gate_up.shape), _placeholder(plain.down.shape),
                                  gate_up_q=quantized.gate_up_q, down_q=quantized.down_q, **extra)
        assert not NativeExperts.supports(quantized)
    for a, b in zip(_run(reference, quantized, inputs, grad_out), _run(reference, plain, inputs, grad_out)):
        assert torch.equal(a, b)
    by_layer = PerLayerExperts(NativeExperts(ISAS[-1]))  # backend="auto": native where it runs, else the reference
    for a, b in zip(_run(by_layer, quantized, inputs, grad_out), _run(by_layer, plain, inputs, grad_out)):
        assert torch.equal(a, b)
    x, index, w, *loras = inputs
    expected = reference.autograd(plain, x.float(), index, w, *loras)
    assert torch.equal(reference.autograd(quantized, x.float(), index, w, *loras), expected)


def test_quantized_weights_are_read_in_place_and_refuse_prepack():
    quantized, _, inputs, _ = _problem("int8", None, 8, 4, 32, 16, 2, 2, seed=6)
    native = NativeExperts(ISAS[-1])
    assert native.supports(quantized)
    gate_up, down = native._matrices(quantized)  # what the kernels get: the quantized copies, no bf16 one
    assert gate_up is quantized.gate_up_q and down is quantized.down_q
    prepacked = NativeExperts(ISAS[-1], prepack=True)
    with pytest.raises(MoeccError, match="prepack_weights=False"):
        prepacked.prepare_layers([quantized])
    quantized.cache_owner = types.SimpleNamespace()
    with pytest.raises(MoeccError, match="held in int8"):
        prepacked.forward(quantized, *inputs)
    bf16 = (torch.zeros(4, 32, 32, dtype=torch.bfloat16), torch.zeros(4, 32, 16, dtype=torch.bfloat16))
    packed = tuple(_ops.pack_expert_weights("portable", m) for m in bf16)
    offsets, order = _ops.group_tokens_by_expert(inputs[1], 4)
    with pytest.raises(ValueError, match="would hold the experts twice"):
        _ops.expert_ffn_forward("portable", (quantized.gate_up_q, bf16[1]), (4, 32, 16), 2, inputs[0], offsets, order,
                                inputs[2].reshape(-1).contiguous(), None, None, packed=packed)


def test_quantized_inputs_are_checked_before_crossing():
    quantized, _, (x, index, w, *_), _ = _problem("int4", 32, 8, 4, 64, 32, 2, 0, seed=7)
    offsets, order = _ops.group_tokens_by_expert(index, 4)
    routing = w.reshape(-1).contiguous()
    q = quantized.gate_up_q

    def run(gate_up):
        _ops.expert_ffn_forward("portable", (gate_up, quantized.down_q), (4, 64, 32), 2, x, offsets, order, routing,
                                None, None)

    run(q)
    bad = [(QuantizedMatrices("nf4", q.data, q.scales, q.shape, q.group), "'nf4' is not a format"),
           (QuantizedMatrices("int4", q.data, q.scales, (4, 64, 32), q.group), "must be \\[4, 64, 64\\]"),
           (QuantizedMatrices("int4", q.data, q.scales, q.shape, 48), "take no scale group 48"),
           (QuantizedMatrices("int4", q.data.view(torch.int8), q.scales, q.shape, q.group),
            "codes must be torch.uint8"),
           (QuantizedMatrices("int4", q.data, q.scales[:, :, :1].contiguous(), q.shape, q.group),
            "scales must be \\[4, 64, 2\\]"),
           (QuantizedMatrices("int4", q.data, q.scales.double(), q.shape, q.group), "scales must be torch.float32"),
           (QuantizedMatrices("int4", q.data.transpose(0, 1).contiguous().transpose(0, 1), q.scales, q.shape,
                              q.group), "codes must be contiguous")]
    for gate_up, message in bad:
        with pytest.raises(ValueError, match=message):
            run(gate_up)
    unsupported = ExpertWeights(quantized.gate_up, quantized.down, gate_up_q=bad[0][0], down_q=quantized.down_q)
    assert not NativeExperts.supports(unsupported)
