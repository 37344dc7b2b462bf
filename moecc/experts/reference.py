"""The slow, obviously-correct routed-expert math with LoRA: the oracle every fast path is tested against.

Works on any device: host tensors for co-compute, device tensors for offload (weights, activations and LoRA
factors on the same device). Layouts: :mod:`moecc.experts.types`.

This computes exactly what Hugging Face's experts + PEFT compute, in the same order, one expert at a time:
the effective weight ``W_e + s * B_e @ A_e`` is formed per expert (PEFT folds the factors the same way), every
product and elementwise result is rounded to the activation dtype where that pipeline rounds it, and the top-k
outputs are summed per token in slot order. The backward pass is autograd of that pipeline written out by hand
(base weights are frozen, so only input-side products are needed; gate/up pre-activations are kept from the
forward pass). Given a subset of the experts it computes the same products for that subset's pairs, bit for
bit, and nothing for the others. With float32 activations every rounding is the identity. The fast kernels
compute the LoRA factorised instead and are compared against this at the tolerance of their dtype.

Quantized frozen weights (``ExpertWeights.gate_up_q`` / ``down_q``) are dequantized one expert at a time, as the
loops reach it (:func:`moecc.experts.formats.dequantize`: bf16 values, transposed into the model's layout where
``transposed``), so memory holds one expert's bf16 matrices at most, on any machine and device.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .activation import activate, activation_grads, merge, round_to, split
from .formats import dequantize
from .grouping import Grouping, kept_rows, resolve
from .types import ExpertLora, ExpertWeights, LoraGrads, SavedState


def supports(weights: ExpertWeights) -> bool:
    """Every dtype and layout."""
    return True


def release_result(tensor: torch.Tensor) -> None:
    """Nothing to hand back: results are fresh tensors."""


def prepare_layers(weights: list[ExpertWeights]) -> None:
    """Nothing to prepare."""


def keep_experts(weights: ExpertWeights, saved: SavedState, experts) -> SavedState:
    """``saved`` with only ``experts``' pairs: its backward computes those alone (hybrid: the others' backward
    runs on the other side). Also the grouped backend's, whose saved state has the same layout."""
    rows, offsets = kept_rows(saved.offsets, experts)
    rows = rows.to(saved.order.device)
    return replace(saved, offsets=offsets.to(saved.offsets.device), order=saved.order[rows],
                   gate_up_out=saved.gate_up_out[rows], lora_inner=None)


def _matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a ``dtype`` matrix product (inputs and result in ``dtype``), returned as float32."""
    return a @ b if dtype == torch.float32 else (a.to(dtype) @ b.to(dtype)).float()


def _expert_lora(lora: ExpertLora | None, expert: int) -> tuple | None:
    if lora is None:
        return None
    a, b = lora.factors(expert)
    return a, b, lora.scaling


def _effective_weight(weight: torch.Tensor, lora: tuple | None, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """``W + s * B @ A`` (``W + s * A.T @ B.T`` for transposed storage) in float32, in the stored orientation,
    formed as PEFT forms it in ``dtype``: factors and result rounded to ``dtype``."""
    if lora is None:
        return weight.float()
    a, b, scaling = lora
    a, b = round_to(a, dtype), round_to(b, dtype)
    delta = a.T @ b.T if transposed else b @ a
    return round_to(weight.float() + scaling * delta, dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """``x @ W.T`` (``x @ W`` when transposed) in ``dtype``, then ``+ bias`` rounded as an in-place add."""
    out = _matmul(x, weight if transposed else weight.T, dtype)
    return out if bias is None else round_to(out + bias.float(), dtype)


def _linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, transposed: bool, dtype: torch.dtype):
    return _matmul(grad, weight.T if transposed else weight, dtype)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the (effective) weight in its stored orientation."""
    return _matmul(x.T, grad, dtype) if transposed else _matmul(grad.T, x, dtype)


def _weight(weights: ExpertWeights, name: str, expert: int, device: torch.device) -> torch.Tensor:
    """Expert ``expert``'s ``gate_up`` or ``down`` matrix in the model's layout: a view of the stored tensor, or its
    quantized copy dequantized (QuantizedMatrices are [N out, K in] whatever ``transposed`` says)."""
    quantized = getattr(weights, f"{name}_q")
    if quantized is None:
        return getattr(weights, name)[expert]
    matrix = dequantize(quantized.experts(expert))[0]  # [N, K] bf16
    # laid out as the model stores it, so the products (their order of summation) are those of its own weights
    return (matrix.T.contiguous() if weights.transposed else matrix).to(device)


def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def forward(weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None, *, expert_mask: torch.Tensor | None = None,
            grouping: Grouping | None = None) -> tuple[torch.Tensor, SavedState]:
    """``y[t] = sum_j w[t,j] * down_e(act(gate_e(x[t]), up_e(x[t])))`` with ``e = top_k_index[t,j]``, the sum
    over the pairs of the experts in ``expert_mask`` / ``grouping`` when given (see ``ExpertBackend``).

    Args:
        hidden: ``[T, H]``. top_k_index: ``[T, k]`` int. top_k_weights: ``[T, k]`` float.
    Returns:
        ``(y [T, H] in hidden's dtype, state for backward)``.
    """
    num_tokens, top_k = top_k_index.shape
    grouping = resolve(top_k_index, weights.num_experts, expert_mask, grouping)
    offsets, order = grouping.offsets, grouping.order
    routing = top_k_weights.float().reshape(-1)  # [T*k]
    dtype, transposed = hidden.dtype, weights.transposed
    weighted_dtype = torch.promote_types(dtype, top_k_weights.dtype)  # the dtype of y * w in PyTorch
    device = hidden.device
    weighted = torch.zeros(num_tokens * top_k, weights.hidden_size, dtype=weighted_dtype, device=device)
    gate_up_out = torch.empty(order.numel(), 2 * weights.intermediate_size, dtype=dtype, device=device)
    bounds = offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = order[start:end]
        x = hidden[pairs // top_k].float()  # [n, H]
        w_gate_up = _effective_weight(_weight(weights, "gate_up", expert, device), _expert_lora(gate_up_lora, expert),
                                      dtype, transposed)
        gu = _linear(x, w_gate_up, _bias(weights.gate_up_bias, expert), transposed, dtype)  # [n, 2I]
        gate_up_out[start:end] = gu
        act = activate(*split(gu, weights.interleaved), weights, dtype)  # [n, I]
        w_down = _effective_weight(_weight(weights, "down", expert, device), _expert_lora(down_lora, expert), dtype,
                                   transposed)
        y = _linear(act, w_down, _bias(weights.down_bias, expert), transposed, dtype)  # [n, H]
        weighted[pairs] = (y * routing[pairs, None]).to(weighted_dtype)
    out = weighted.view(num_tokens, top_k, weights.hidden_size).sum(dim=1)  # [T, H], summed in slot order
    saved = SavedState(hidden.clone(), top_k_weights.float().clone(), offsets, order, gate_up_out,
                       top_k_weights.dtype)
    return out.to(dtype), saved


def _store_lora_grads(grad_weight: torch.Tensor, lora: ExpertLora, expert: int, grad_a: torch.Tensor,
                      grad_b: torch.Tensor, dtype: torch.dtype, transposed: bool) -> None:
    """Gradients of one expert's factors from its effective weight's gradient, written in PEFT layout.

    Autograd of PEFT's fold ``W + s * lhs @ rhs`` gives ``d lhs = s * dW @ rhs.T`` and ``d rhs = s * lhs.T @ dW``,
    each product rounded to ``dtype`` and the multiply by ``s`` skipped when it is exactly 1; ``(lhs, rhs)`` is
    ``(B, A)``, or ``(A.T, B.T)`` for transposed storage.
    """
    a, b = lora.factors(expert)
    a, b = round_to(a, dtype), round_to(b, dtype)
    scaling, r = lora.scaling, lora.rank

    def times_scaling(t):
        return t if scaling == 1 else round_to(t * scaling, dtype)

    if transposed:
        grad_a_e = times_scaling(_matmul(grad_weight, b, dtype)).T  # [r, in]
        grad_b_e = times_scaling(_matmul(a, grad_weight, dtype)).T  # [out, r]
    else:
        grad_b_e = times_scaling(_matmul(grad_weight, a.T, dtype))
        grad_a_e = times_scaling(_matmul(b.T, grad_weight, dtype))
    grad_b.view(grad_b.shape[0], r, lora.num_experts)[:, :, expert] = grad_b_e
    grad_a[expert * r : (expert + 1) * r] = grad_a_e


def backward(weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor, gate_up_lora: ExpertLora | None,
             down_lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
    """Gradients of :func:`forward` for the hidden states, routing weights and LoRA factors, over the experts
    forward computed (zeros elsewhere).

    Returns:
        ``(grad_hidden [T, H], grad_top_k_weights [T, k], LoraGrads)``, float32 tensors holding values of the
        activation / routing-weight dtype.
    """
    dtype, transposed = saved.hidden.dtype, weights.transposed
    weighted_dtype = torch.promote_types(dtype, saved.weights_dtype)
    num_tokens, top_k = saved.top_k_weights.shape
    routing = saved.top_k_weights.reshape(-1)
    device = saved.hidden.device
    grad_hidden = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32, device=device)
    grad_routing = torch.zeros(num_tokens * top_k, dtype=torch.float32, device=device)
    grads = LoraGrads.zeros(gate_up_lora, down_lora)
    bounds = saved.offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = saved.order[start:end]
        tokens = pairs // top_k
        w = routing[pairs, None]  # [n, 1]
        grad_z = grad_out[tokens].float()  # [n, H], gradient of this pair's weighted output
        gate, up = split(saved.gate_up_out[start:end].float(), weights.interleaved)
        act = activate(gate, up, weights, dtype)  # [n, I]

        w_down = _effective_weight(_weight(weights, "down", expert, device), _expert_lora(down_lora, expert), dtype,
                                   transposed)
        y = _linear(act, w_down, _bias(weights.down_bias, expert), transposed, dtype)  # [n, H], recomputed
        grad_routing[pairs] = round_to(round_to(grad_z * y, weighted_dtype).sum(-1), weighted_dtype)
        grad_y = round_to(grad_z * w, dtype)
        grad_act = _linear_input_grad(grad_y, w_down, transposed, dtype)  # [n, I]
        if down_lora is not None:
            _store_lora_grads(_weight_grad(grad_y, act, transposed, dtype), down_lora, expert, grads.down_A,
                              grads.down_B, dtype, transposed)

        grad_gu = merge(*activation_grads(grad_act, gate, up, weights, dtype), weights.interleaved)  # [n, 2I]
        w_gate_up = _effective_weight(_weight(weights, "gate_up", expert, device), _expert_lora(gate_up_lora, expert),
                                      dtype, transposed)
        if gate_up_lora is not None:
            x = saved.hidden[tokens].float()
            _store_lora_grads(_weight_grad(grad_gu, x, transposed, dtype), gate_up_lora, expert, grads.gate_up_A,
                              grads.gate_up_B, dtype, transposed)
        # Per-token sum over its experts, in ascending expert order, rounded after each addition.
        grad_hidden.index_add_(0, tokens, _linear_input_grad(grad_gu, w_gate_up, transposed, dtype))
        grad_hidden[tokens] = round_to(grad_hidden[tokens], dtype)
    return grad_hidden, grad_routing.view(num_tokens, top_k), grads


def autograd(weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> torch.Tensor:
    """The same function as :func:`forward` in float32, written so torch autograd differentiates it:
    an independent derivation used to check :func:`backward`. Differentiable in hidden,
    top_k_weights and the LoRA A/B tensors."""
    num_tokens, _ = top_k_index.shape
    out = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32)
    for expert in range(weights.num_experts):
        token_ids, slots = torch.nonzero(top_k_index == expert, as_tuple=True)
        if token_ids.numel() == 0:
            continue
        projections = []
        for name, bias, lora in (("gate_up", weights.gate_up_bias, gate_up_lora),
                                 ("down", weights.down_bias, down_lora)):
            w = _weight(weights, name, expert, hidden.device).float()
            w = w.T if weights.transposed else w  # [out, in]
            if lora is not None:
                a, b = lora.factors(expert)
                w = w + lora.scaling * b @ a
            projections.append((w, None if bias is None else bias[expert].float()))
        (w_gate_up, b_gate_up), (w_down, b_down) = projections
        gu = hidden[token_ids].float() @ w_gate_up.T + (0 if b_gate_up is None else b_gate_up)
        act = activate(*split(gu, weights.interleaved), weights, torch.float32)
        y = act @ w_down.T + (0 if b_down is None else b_down)
        out = out.index_add(0, token_ids, y * top_k_weights[token_ids, slots, None].float())
    return out
