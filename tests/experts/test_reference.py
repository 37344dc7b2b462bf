"""The reference expert math: forward against an independent per-expert formulation, backward against autograd."""
from __future__ import annotations

import pytest
import torch

from moecc.experts import ExpertLora, ExpertWeights
from moecc.experts.reference import autograd, backward, forward

from ..parity import rel_err


def _problem(num_tokens, num_experts=6, hidden=24, inter=10, top_k=2, rank=3, dtype=torch.float32, seed=0,
             lora=True):
    g = torch.Generator().manual_seed(seed)
    weights = ExpertWeights((torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
                            (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(dtype))

    def factors(inp, out):
        return ExpertLora(torch.randn(rank * num_experts, inp, generator=g).requires_grad_(),
                          torch.randn(out, rank * num_experts, generator=g).requires_grad_(), 0.7, num_experts)

    gate_up = factors(hidden, 2 * inter) if lora else None
    down = factors(inter, hidden) if lora else None
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, top_k, dtype=torch.int64)
    index[:, 0] = index[:, 0].clamp(max=num_experts - 2)  # expert E-1 sees few tokens, some none
    w = torch.rand(num_tokens, top_k, generator=g)
    if num_tokens > 3:
        w[3, 1] = 0.0  # a zero routing weight still has a gradient
    return weights, x, index, w, gate_up, down


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
@pytest.mark.parametrize("lora", [True, False])
def test_forward_and_backward_match_autograd(num_tokens, lora):
    weights, x, index, w, gate_up, down = _problem(num_tokens, lora=lora)
    out, saved = forward(weights, x, index, w, gate_up, down)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = autograd(weights, x_ref, index, w_ref, gate_up, down)
    assert out.shape == (num_tokens, 24)
    assert rel_err(out, expected) <= 1e-5
    if num_tokens == 0:
        return
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    grad_x, grad_w, grads = backward(weights, saved, grad_out, gate_up, down)
    assert rel_err(grad_x, x_ref.grad) <= 1e-5
    assert rel_err(grad_w, w_ref.grad) <= 1e-5
    assert grad_w[3, 1] != 0 if num_tokens > 3 else True
    if lora:
        for got, lora_factors in ((grads.gate_up_A, gate_up.A), (grads.gate_up_B, gate_up.B),
                                  (grads.down_A, down.A), (grads.down_B, down.B)):
            assert rel_err(got, lora_factors.grad) <= 1e-5
    else:
        assert grads.gate_up_A is None and grads.down_B is None


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_gpt_oss_layout_matches_autograd(num_tokens):
    """Transposed storage, interleaved gate/up, biases and an active clamp on both sides."""
    weights, x, index, w, gate_up, down = _problem(num_tokens, seed=3)
    g = torch.Generator().manual_seed(9)
    weights = ExpertWeights(
        gate_up=weights.gate_up.transpose(1, 2).contiguous(), down=weights.down.transpose(1, 2).contiguous(),
        gate_up_bias=torch.randn(6, 20, generator=g) * 0.1, down_bias=torch.randn(6, 24, generator=g) * 0.1,
        transposed=True, interleaved=True, swiglu_alpha=1.702, swiglu_limit=0.5,
    )
    out, saved = forward(weights, x, index, w, gate_up, down)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = autograd(weights, x_ref, index, w_ref, gate_up, down)
    assert rel_err(out, expected) <= 1e-5
    clamped = saved.gate_up_out.float()
    assert (clamped[:, 0::2] > 0.5).any() and (clamped[:, 1::2].abs() > 0.5).any()
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    grad_x, grad_w, grads = backward(weights, saved, grad_out, gate_up, down)
    assert rel_err(grad_x, x_ref.grad) <= 1e-5
    assert rel_err(grad_w, w_ref.grad) <= 1e-5
    for got, factors in ((grads.gate_up_A, gate_up.A), (grads.gate_up_B, gate_up.B), (grads.down_A, down.A),
                         (grads.down_B, down.B)):
        assert rel_err(got, factors.grad) <= 1e-5


def test_bf16_forward_close_to_float32():
    weights, x, index, w, gate_up, down = _problem(33, dtype=torch.bfloat16)
    out, _ = forward(weights, x, index, w, gate_up, down)
    assert out.dtype == torch.bfloat16
    expected = autograd(weights, x, index, w, gate_up, down)
    assert rel_err(out, expected) <= 2e-2


def test_invalid_expert_id_is_a_clear_error():
    weights, x, index, w, gate_up, down = _problem(5)
    index[2, 1] = 6
    with pytest.raises(ValueError, match=r"top_k_index\[2, 1\] = 6"):
        forward(weights, x, index, w, gate_up, down)
