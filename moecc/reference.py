"""The slow, obviously-correct routed-expert math with LoRA: the oracle every fast path is tested against.

Layouts (Hugging Face fused experts, PEFT ``target_parameters`` LoRA):
    gate_up  [E, 2I, H]   rows [0, I) are the gate projection, [I, 2I) the up projection
    down     [E, H, I]
    lora A   [r*E, in]    expert e uses rows e*r .. (e+1)*r          (expert-major)
    lora B   [out, r*E]   expert e uses columns e, e+E, e+2E, ...    (rank-major)

This computes exactly what Hugging Face's experts + PEFT compute, in the same order, one expert at a time:
the effective weight ``W_e + s * B_e @ A_e`` is formed per expert (PEFT folds the factors the same way), every
product and elementwise result is rounded to the activation dtype where that pipeline rounds it, and the top-k
outputs are summed per token in slot order. The backward pass is autograd of that pipeline written out by hand
(base weights are frozen, so only input-side products are needed; gate/up pre-activations are kept from the
forward pass). With float32 activations every rounding is the identity. The fast kernels compute the LoRA
factorised instead and are compared against this at the tolerance of their dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _ops


@dataclass
class ExpertLora:
    """LoRA factors of one fused expert projection, in PEFT's layout (see module docstring)."""

    A: torch.Tensor  # [r*E, in]
    B: torch.Tensor  # [out, r*E]
    scaling: float
    num_experts: int

    @property
    def rank(self) -> int:
        return self.A.shape[0] // self.num_experts

    def factors(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A_e [r, in], B_e [out, r])`` of one expert, as float32 views or copies."""
        r = self.rank
        a = self.A[expert * r : (expert + 1) * r]
        b = self.B.view(self.B.shape[0], r, self.num_experts)[:, :, expert]
        return a.float(), b.float()


@dataclass
class ExpertWeights:
    """Frozen base weights of one MoE layer's routed experts, in host memory."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]


@dataclass
class SavedState:
    """What backward needs from forward, held in host memory."""

    hidden: torch.Tensor  # [T, H] activation dtype
    top_k_weights: torch.Tensor  # [T, k] float32
    offsets: torch.Tensor  # [E+1] int64
    order: torch.Tensor  # [T*k] int64, pair ids grouped by expert
    gate_up_out: torch.Tensor  # [T*k, 2I] activation dtype, pre-activation, in grouped order
    weights_dtype: torch.dtype = torch.float32  # dtype the routing weights arrived in


@dataclass
class LoraGrads:
    """Gradients of one layer's expert LoRA factors, float32, same layouts as the factors."""

    gate_up_A: torch.Tensor | None
    gate_up_B: torch.Tensor | None
    down_A: torch.Tensor | None
    down_B: torch.Tensor | None


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds float32 ``x`` to ``dtype`` and back (the identity for float32)."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def _matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a ``dtype`` matrix product (inputs and result in ``dtype``), returned as float32."""
    return a @ b if dtype == torch.float32 else (a.to(dtype) @ b.to(dtype)).float()


def _expert_lora(lora: ExpertLora | None, expert: int) -> tuple | None:
    if lora is None:
        return None
    a, b = lora.factors(expert)
    return a, b, lora.scaling


def _effective_weight(weight: torch.Tensor, lora: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """``W + s * B @ A`` in float32 as PEFT forms it in ``dtype``: factors and result rounded to ``dtype``."""
    if lora is None:
        return weight.float()
    a, b, scaling = lora
    return _round(weight.float() + scaling * (_round(b, dtype) @ _round(a, dtype)), dtype)


def experts_forward(
    weights: ExpertWeights,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_lora: ExpertLora | None,
    down_lora: ExpertLora | None,
) -> tuple[torch.Tensor, SavedState]:
    """``y[t] = sum_j w[t,j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = top_k_index[t,j]``.

    Args:
        hidden: ``[T, H]`` host tensor. top_k_index: ``[T, k]`` int. top_k_weights: ``[T, k]`` float.
    Returns:
        ``(y [T, H] in hidden's dtype, state for experts_backward)``.
    """
    num_tokens, top_k = top_k_index.shape
    inter = weights.intermediate_size
    offsets, order = _ops.group_tokens_by_expert(top_k_index, weights.num_experts)
    routing = top_k_weights.float().reshape(-1)  # [T*k]
    dtype = hidden.dtype
    weighted_dtype = torch.promote_types(dtype, top_k_weights.dtype)  # the dtype of y * w in PyTorch
    weighted = torch.zeros(num_tokens * top_k, weights.hidden_size, dtype=weighted_dtype)  # per (token, slot)
    gate_up_out = torch.empty(num_tokens * top_k, 2 * inter, dtype=dtype)
    bounds = offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = order[start:end]
        x = hidden[pairs // top_k].float()  # [n, H]
        w_gate_up = _effective_weight(weights.gate_up[expert], _expert_lora(gate_up_lora, expert), dtype)
        gu = _matmul(x, w_gate_up.T, dtype)  # [n, 2I]
        gate_up_out[start:end] = gu
        act = _round(_round(F.silu(gu[:, :inter]), dtype) * gu[:, inter:], dtype)  # [n, I]
        w_down = _effective_weight(weights.down[expert], _expert_lora(down_lora, expert), dtype)
        y = _matmul(act, w_down.T, dtype)  # [n, H]
        weighted[pairs] = (y * routing[pairs, None]).to(weighted_dtype)
    out = weighted.view(num_tokens, top_k, weights.hidden_size).sum(dim=1)  # [T, H], summed in slot order
    saved = SavedState(hidden.clone(), top_k_weights.float().clone(), offsets, order, gate_up_out,
                       top_k_weights.dtype)
    return out.to(dtype), saved


def _new_lora_grads(gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> LoraGrads:
    def zeros(lora, name):
        return None if lora is None else torch.zeros(getattr(lora, name).shape, dtype=torch.float32)

    return LoraGrads(zeros(gate_up_lora, "A"), zeros(gate_up_lora, "B"), zeros(down_lora, "A"), zeros(down_lora, "B"))


def _store_lora_grads(grad_weight: torch.Tensor, lora: ExpertLora, expert: int, grad_a: torch.Tensor,
                      grad_b: torch.Tensor, dtype: torch.dtype) -> None:
    """Gradients of one expert's factors from its effective weight's gradient, written in PEFT layout.

    Autograd of ``W + s * B @ A`` gives ``dB = s * dW @ A.T`` and ``dA = s * B.T @ dW``, each product rounded
    to ``dtype`` and the multiply by ``s`` skipped when it is exactly 1.
    """
    a, b = lora.factors(expert)
    scaling, r = lora.scaling, lora.rank

    def times_scaling(t):
        return t if scaling == 1 else _round(t * scaling, dtype)

    grad_b.view(grad_b.shape[0], r, lora.num_experts)[:, :, expert] = times_scaling(_matmul(grad_weight, a.T, dtype))
    grad_a[expert * r : (expert + 1) * r] = times_scaling(_matmul(b.T, grad_weight, dtype))


def experts_backward(
    weights: ExpertWeights,
    saved: SavedState,
    grad_out: torch.Tensor,
    gate_up_lora: ExpertLora | None,
    down_lora: ExpertLora | None,
) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
    """Gradients of :func:`experts_forward` for the hidden states, routing weights and LoRA factors.

    Returns:
        ``(grad_hidden [T, H], grad_top_k_weights [T, k], LoraGrads)``, float32 tensors holding values of the
        activation / routing-weight dtype.
    """
    dtype = saved.hidden.dtype
    weighted_dtype = torch.promote_types(dtype, saved.weights_dtype)
    num_tokens, top_k = saved.top_k_weights.shape
    inter = weights.intermediate_size
    routing = saved.top_k_weights.reshape(-1)
    grad_hidden = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32)
    grad_routing = torch.zeros(num_tokens * top_k, dtype=torch.float32)
    grads = _new_lora_grads(gate_up_lora, down_lora)
    bounds = saved.offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = saved.order[start:end]
        tokens = pairs // top_k
        w = routing[pairs, None]  # [n, 1]
        grad_z = grad_out[tokens].float()  # [n, H], gradient of this pair's weighted output
        gu = saved.gate_up_out[start:end].float()
        gate, up = gu[:, :inter], gu[:, inter:]
        silu = _round(F.silu(gate), dtype)
        act = _round(silu * up, dtype)  # [n, I]

        w_down = _effective_weight(weights.down[expert], _expert_lora(down_lora, expert), dtype)
        y = _matmul(act, w_down.T, dtype)  # [n, H], this expert's unweighted output (recomputed)
        grad_routing[pairs] = _round(_round(grad_z * y, weighted_dtype).sum(-1), weighted_dtype)
        grad_y = _round(grad_z * w, dtype)
        grad_act = _matmul(grad_y, w_down, dtype)  # [n, I]
        if down_lora is not None:
            _store_lora_grads(_matmul(grad_y.T, act, dtype), down_lora, expert, grads.down_A, grads.down_B, dtype)

        sig = torch.sigmoid(gate)
        grad_gate = _round(_round(grad_act * up, dtype) * sig * (1 + gate * (1 - sig)), dtype)
        grad_gu = torch.cat([grad_gate, _round(grad_act * silu, dtype)], dim=1)  # [n, 2I]
        w_gate_up = _effective_weight(weights.gate_up[expert], _expert_lora(gate_up_lora, expert), dtype)
        if gate_up_lora is not None:
            grad_weight = _matmul(grad_gu.T, saved.hidden[tokens].float(), dtype)  # [2I, H]
            _store_lora_grads(grad_weight, gate_up_lora, expert, grads.gate_up_A, grads.gate_up_B, dtype)
        # Per-token sum over its experts, in ascending expert order, rounded after each addition.
        grad_hidden.index_add_(0, tokens, _matmul(grad_gu, w_gate_up, dtype))
        grad_hidden[tokens] = _round(grad_hidden[tokens], dtype)
    return grad_hidden, grad_routing.view(num_tokens, top_k), grads


def experts_autograd(
    weights: ExpertWeights,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_lora: ExpertLora | None,
    down_lora: ExpertLora | None,
) -> torch.Tensor:
    """The same function as :func:`experts_forward`, written so torch autograd can differentiate it.

    Materialises ``W_e + s * B_e @ A_e`` per expert, the way PEFT does: a second, independent derivation used
    to check :func:`experts_backward`. Differentiable in hidden, top_k_weights and the LoRA A/B tensors.
    """
    num_tokens, top_k = top_k_index.shape
    inter = weights.intermediate_size
    out = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32)
    for expert in range(weights.num_experts):
        token_ids, slots = torch.nonzero(top_k_index == expert, as_tuple=True)
        if token_ids.numel() == 0:
            continue
        w_gu = weights.gate_up[expert].float()
        w_down = weights.down[expert].float()
        if gate_up_lora is not None:
            a, b = gate_up_lora.factors(expert)
            w_gu = w_gu + gate_up_lora.scaling * b @ a
        if down_lora is not None:
            a, b = down_lora.factors(expert)
            w_down = w_down + down_lora.scaling * b @ a
        gu = hidden[token_ids].float() @ w_gu.T
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down.T
        out = out.index_add(0, token_ids, y * top_k_weights[token_ids, slots, None].float())
    return out
