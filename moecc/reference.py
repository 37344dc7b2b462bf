"""The slow, obviously-correct routed-expert math with LoRA: the oracle every fast path is tested against.

Works on any device: host tensors for co-compute, device tensors for offload (weights, activations and LoRA
factors on the same device).

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
    """Frozen base weights of one MoE layer's routed experts, in host memory, in the model's own layout.

    Default layout ``gate_up [E, 2I, H]``, ``down [E, H, I]`` with gate rows before up rows and SwiGLU
    ``silu(gate) * up``. gpt-oss differs: ``transposed`` (``gate_up [E, H, 2I]``, ``down [E, I, H]``),
    ``interleaved`` gate/up columns, biases, and a clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)`` when ``swiglu_limit`` is set.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]
    transposed: bool = False
    interleaved: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # For backends that keep derived copies (packed layouts): the object to keep them on, and a value that
    # changes whenever the weights do (PEFT's merged adapters), since in-place writes through ``.data`` do not
    # advance a tensor's version counter.
    cache_owner: object | None = None
    revision: tuple = ()

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[1 if self.transposed else 2]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[1 if self.transposed else 2]


@dataclass
class SavedState:
    """What backward needs from forward, held in host memory."""

    hidden: torch.Tensor  # [T, H] activation dtype
    top_k_weights: torch.Tensor  # [T, k] float32
    offsets: torch.Tensor  # [E+1] int64
    order: torch.Tensor  # [T*k] int64, pair ids grouped by expert
    gate_up_out: torch.Tensor  # [T*k, 2I] activation dtype, pre-activation, in grouped order
    weights_dtype: torch.dtype = torch.float32  # dtype the routing weights arrived in
    # The native kernels' LoRA inner products (x A_gu, act A_down: [T*k, r] float32, grouped order, None where a
    # projection has no LoRA), which their backward reuses; None for the other backends
    lora_inner: tuple | None = None


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


def _effective_weight(weight: torch.Tensor, lora: tuple | None, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """``W + s * B @ A`` (``W + s * A.T @ B.T`` for transposed storage) in float32, in the stored orientation,
    formed as PEFT forms it in ``dtype``: factors and result rounded to ``dtype``."""
    if lora is None:
        return weight.float()
    a, b, scaling = lora
    a, b = _round(a, dtype), _round(b, dtype)
    delta = a.T @ b.T if transposed else b @ a
    return _round(weight.float() + scaling * delta, dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """``x @ W.T`` (``x @ W`` when transposed) in ``dtype``, then ``+ bias`` rounded as an in-place add."""
    out = _matmul(x, weight if transposed else weight.T, dtype)
    return out if bias is None else _round(out + bias.float(), dtype)


def _linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, transposed: bool, dtype: torch.dtype):
    return _matmul(grad, weight.T if transposed else weight, dtype)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the (effective) weight in its stored orientation."""
    return _matmul(x.T, grad, dtype) if transposed else _matmul(grad.T, x, dtype)


def _split(gu: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    half = gu.shape[1] // 2
    return gu[:, :half], gu[:, half:]


def _merge(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1)
    return torch.cat([gate, up], dim=1)


def _activate(gate: torch.Tensor, up: torch.Tensor, weights: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """The gated activation, rounded after every elementwise step as the original computes it."""
    if weights.swiglu_limit is None:
        return _round(_round(F.silu(gate), dtype) * up, dtype)
    limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = _round(gate * _round(torch.sigmoid(_round(gate * alpha, dtype)), dtype), dtype)
    return _round(_round(up + 1, dtype) * glu, dtype)


def _activation_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weights: ExpertWeights,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of :func:`_activate`, rounded where autograd of the rounded pipeline rounds."""
    if weights.swiglu_limit is None:
        silu = _round(F.silu(gate), dtype)
        sig = torch.sigmoid(gate)
        grad_gate = _round(_round(grad * up, dtype) * sig * (1 + gate * (1 - sig)), dtype)
        return grad_gate, _round(grad * silu, dtype)
    limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
    gate_c = gate.clamp(max=limit)
    up_c = up.clamp(min=-limit, max=limit)
    sig = _round(torch.sigmoid(_round(gate_c * alpha, dtype)), dtype)
    glu = _round(gate_c * sig, dtype)
    grad_up = _round(grad * glu, dtype) * ((up >= -limit) & (up <= limit))
    grad_glu = _round(grad * _round(up_c + 1, dtype), dtype)
    grad_t = _round(_round(grad_glu * gate_c, dtype) * sig * (1 - sig), dtype)
    grad_gate_c = _round(_round(grad_glu * sig, dtype) + _round(grad_t * alpha, dtype), dtype)
    return grad_gate_c * (gate <= limit), grad_up


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [E+1], order [T*k])``: pair ids grouped by expert, stable; the native sort in host memory."""
    if top_k_index.device.type == "cpu":
        return _ops.group_tokens_by_expert(top_k_index, num_experts)
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return offsets, order


def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def experts_forward(
    weights: ExpertWeights,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_lora: ExpertLora | None,
    down_lora: ExpertLora | None,
) -> tuple[torch.Tensor, SavedState]:
    """``y[t] = sum_j w[t,j] * down_e(act(gate_e(x[t]), up_e(x[t])))`` with ``e = top_k_index[t,j]``.

    Args:
        hidden: ``[T, H]`` host tensor. top_k_index: ``[T, k]`` int. top_k_weights: ``[T, k]`` float.
    Returns:
        ``(y [T, H] in hidden's dtype, state for experts_backward)``.
    """
    num_tokens, top_k = top_k_index.shape
    offsets, order = group_by_expert(top_k_index, weights.num_experts)
    routing = top_k_weights.float().reshape(-1)  # [T*k]
    dtype, transposed = hidden.dtype, weights.transposed
    weighted_dtype = torch.promote_types(dtype, top_k_weights.dtype)  # the dtype of y * w in PyTorch
    device = hidden.device
    weighted = torch.zeros(num_tokens * top_k, weights.hidden_size, dtype=weighted_dtype, device=device)
    gate_up_out = torch.empty(num_tokens * top_k, 2 * weights.intermediate_size, dtype=dtype, device=device)
    bounds = offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = order[start:end]
        x = hidden[pairs // top_k].float()  # [n, H]
        w_gate_up = _effective_weight(weights.gate_up[expert], _expert_lora(gate_up_lora, expert), dtype, transposed)
        gu = _linear(x, w_gate_up, _bias(weights.gate_up_bias, expert), transposed, dtype)  # [n, 2I]
        gate_up_out[start:end] = gu
        act = _activate(*_split(gu, weights.interleaved), weights, dtype)  # [n, I]
        w_down = _effective_weight(weights.down[expert], _expert_lora(down_lora, expert), dtype, transposed)
        y = _linear(act, w_down, _bias(weights.down_bias, expert), transposed, dtype)  # [n, H]
        weighted[pairs] = (y * routing[pairs, None]).to(weighted_dtype)
    out = weighted.view(num_tokens, top_k, weights.hidden_size).sum(dim=1)  # [T, H], summed in slot order
    saved = SavedState(hidden.clone(), top_k_weights.float().clone(), offsets, order, gate_up_out,
                       top_k_weights.dtype)
    return out.to(dtype), saved


def _new_lora_grads(gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> LoraGrads:
    def zeros(lora, name):
        factor = None if lora is None else getattr(lora, name)
        return None if factor is None else torch.zeros(factor.shape, dtype=torch.float32, device=factor.device)

    return LoraGrads(zeros(gate_up_lora, "A"), zeros(gate_up_lora, "B"), zeros(down_lora, "A"), zeros(down_lora, "B"))


def _store_lora_grads(grad_weight: torch.Tensor, lora: ExpertLora, expert: int, grad_a: torch.Tensor,
                      grad_b: torch.Tensor, dtype: torch.dtype, transposed: bool) -> None:
    """Gradients of one expert's factors from its effective weight's gradient, written in PEFT layout.

    Autograd of PEFT's fold ``W + s * lhs @ rhs`` gives ``d lhs = s * dW @ rhs.T`` and ``d rhs = s * lhs.T @ dW``,
    each product rounded to ``dtype`` and the multiply by ``s`` skipped when it is exactly 1; ``(lhs, rhs)`` is
    ``(B, A)``, or ``(A.T, B.T)`` for transposed storage.
    """
    a, b = lora.factors(expert)
    a, b = _round(a, dtype), _round(b, dtype)
    scaling, r = lora.scaling, lora.rank

    def times_scaling(t):
        return t if scaling == 1 else _round(t * scaling, dtype)

    if transposed:
        grad_a_e = times_scaling(_matmul(grad_weight, b, dtype)).T  # [r, in]
        grad_b_e = times_scaling(_matmul(a, grad_weight, dtype)).T  # [out, r]
    else:
        grad_b_e = times_scaling(_matmul(grad_weight, a.T, dtype))
        grad_a_e = times_scaling(_matmul(b.T, grad_weight, dtype))
    grad_b.view(grad_b.shape[0], r, lora.num_experts)[:, :, expert] = grad_b_e
    grad_a[expert * r : (expert + 1) * r] = grad_a_e


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
    dtype, transposed = saved.hidden.dtype, weights.transposed
    weighted_dtype = torch.promote_types(dtype, saved.weights_dtype)
    num_tokens, top_k = saved.top_k_weights.shape
    routing = saved.top_k_weights.reshape(-1)
    device = saved.hidden.device
    grad_hidden = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32, device=device)
    grad_routing = torch.zeros(num_tokens * top_k, dtype=torch.float32, device=device)
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
        gate, up = _split(saved.gate_up_out[start:end].float(), weights.interleaved)
        act = _activate(gate, up, weights, dtype)  # [n, I]

        w_down = _effective_weight(weights.down[expert], _expert_lora(down_lora, expert), dtype, transposed)
        y = _linear(act, w_down, _bias(weights.down_bias, expert), transposed, dtype)  # [n, H], recomputed
        grad_routing[pairs] = _round(_round(grad_z * y, weighted_dtype).sum(-1), weighted_dtype)
        grad_y = _round(grad_z * w, dtype)
        grad_act = _linear_input_grad(grad_y, w_down, transposed, dtype)  # [n, I]
        if down_lora is not None:
            _store_lora_grads(_weight_grad(grad_y, act, transposed, dtype), down_lora, expert, grads.down_A,
                              grads.down_B, dtype, transposed)

        grad_gu = _merge(*_activation_grads(grad_act, gate, up, weights, dtype), weights.interleaved)  # [n, 2I]
        w_gate_up = _effective_weight(weights.gate_up[expert], _expert_lora(gate_up_lora, expert), dtype, transposed)
        if gate_up_lora is not None:
            x = saved.hidden[tokens].float()
            _store_lora_grads(_weight_grad(grad_gu, x, transposed, dtype), gate_up_lora, expert, grads.gate_up_A,
                              grads.gate_up_B, dtype, transposed)
        # Per-token sum over its experts, in ascending expert order, rounded after each addition.
        grad_hidden.index_add_(0, tokens, _linear_input_grad(grad_gu, w_gate_up, transposed, dtype))
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
    """The same function as :func:`experts_forward` in float32, written so torch autograd differentiates it:
    an independent derivation used to check :func:`experts_backward`. Differentiable in hidden,
    top_k_weights and the LoRA A/B tensors."""
    num_tokens, _ = top_k_index.shape
    out = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32)
    for expert in range(weights.num_experts):
        token_ids, slots = torch.nonzero(top_k_index == expert, as_tuple=True)
        if token_ids.numel() == 0:
            continue
        projections = []
        for weight, bias, lora in ((weights.gate_up, weights.gate_up_bias, gate_up_lora),
                                   (weights.down, weights.down_bias, down_lora)):
            w = weight[expert].float()
            w = w.T if weights.transposed else w  # [out, in]
            if lora is not None:
                a, b = lora.factors(expert)
                w = w + lora.scaling * b @ a
            projections.append((w, None if bias is None else bias[expert].float()))
        (w_gate_up, b_gate_up), (w_down, b_down) = projections
        gu = hidden[token_ids].float() @ w_gate_up.T + (0 if b_gate_up is None else b_gate_up)
        act = _activate(*_split(gu, weights.interleaved), weights, torch.float32)
        y = act @ w_down.T + (0 if b_down is None else b_down)
        out = out.index_add(0, token_ids, y * top_k_weights[token_ids, slots, None].float())
    return out
