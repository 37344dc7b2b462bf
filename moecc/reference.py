"""The slow, obviously-correct routed-expert math with LoRA: the oracle every fast path is tested against.

Layouts (Hugging Face fused experts, PEFT ``target_parameters`` LoRA):
    gate_up  [E, 2I, H]   rows [0, I) are the gate projection, [I, 2I) the up projection
    down     [E, H, I]
    lora A   [r*E, in]    expert e uses rows e*r .. (e+1)*r          (expert-major)
    lora B   [out, r*E]   expert e uses columns e, e+E, e+2E, ...    (rank-major)
    W_e + scaling * B_e @ A_e is expert e's effective weight; it is never materialised here.

Products accumulate in float32. With bf16/fp16 activations, intermediate results are rounded to that dtype
where a bf16 pipeline rounds them (gate/up outputs, SiLU, SiLU·up, each expert's output, the routing-weighted
output), which is also where Hugging Face's experts round them; the sum over the top-k experts accumulates in
float32. See ``_project`` for how LoRA enters the effective weight.
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


@dataclass
class LoraGrads:
    """Gradients of one layer's expert LoRA factors, float32, same layouts as the factors."""

    gate_up_A: torch.Tensor | None
    gate_up_B: torch.Tensor | None
    down_A: torch.Tensor | None
    down_B: torch.Tensor | None


def _project(x: torch.Tensor, weight: torch.Tensor, lora: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """One expert's projection ``x @ (W + s * B @ A).T`` in float32; ``lora`` is ``(A_e, B_e, s)`` or None.

    float32 activations: computed factorised, ``x @ W.T + s * (x @ A.T) @ B.T``. Lower-precision activations:
    the effective weight is formed from factors rounded to ``dtype`` and rounded itself, exactly what PEFT
    does for bf16/fp16 experts, so whole-model results match HF + PEFT to summation order.
    """
    if lora is None:
        return x @ weight.float().T
    a, b, scaling = lora
    if dtype == torch.float32:
        return x @ weight.float().T + scaling * ((x @ a.T) @ b.T)
    effective = _round(weight.float() + scaling * (_round(b, dtype) @ _round(a, dtype)), dtype)
    return x @ effective.T


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds float32 ``x`` to the activation dtype, as a kernel that feeds its matrix unit in that dtype does."""
    return x if dtype == torch.float32 else x.to(dtype).float()

def _expert_lora(lora: ExpertLora | None, expert: int) -> tuple | None:
    if lora is None:
        return None
    a, b = lora.factors(expert)
    return a, b, lora.scaling


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
    out = torch.zeros(num_tokens, weights.hidden_size, dtype=torch.float32)
    gate_up_out = torch.empty(num_tokens * top_k, 2 * inter, dtype=hidden.dtype)
    bounds = offsets.tolist()
    for expert in range(weights.num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        pairs = order[start:end]
        tokens = pairs // top_k
        x = hidden[tokens].float()  # [n, H]
        gu = _round(_project(x, weights.gate_up[expert], _expert_lora(gate_up_lora, expert), dtype), dtype)
        gate_up_out[start:end] = gu  # [n, 2I]
        act = _round(_round(F.silu(gu[:, :inter]), dtype) * gu[:, inter:], dtype)  # [n, I]
        y = _round(_project(act, weights.down[expert], _expert_lora(down_lora, expert), dtype), dtype)  # [n, H]
        out.index_add_(0, tokens, _round(y * routing[pairs, None], weighted_dtype))
    saved = SavedState(hidden.clone(), top_k_weights.float().clone(), offsets, order, gate_up_out)
    return out.to(hidden.dtype), saved


def _lora_input_grads(grad_out: torch.Tensor, x: torch.Tensor, lora: tuple) -> tuple:
    """For ``out = s * (x @ A.T) @ B.T``: returns (d x [n, in], dA [r, in], dB [out, r])."""
    a, b, scaling = lora
    grad_inner = scaling * grad_out @ b  # [n, r]
    grad_b = scaling * grad_out.T @ (x @ a.T)  # [out, r]
    return grad_inner @ a, grad_inner.T @ x, grad_b


def _new_lora_grads(gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> LoraGrads:
    def zeros(t):
        return None if t is None else torch.zeros(t.shape, dtype=torch.float32)

    return LoraGrads(
        zeros(gate_up_lora and gate_up_lora.A), zeros(gate_up_lora and gate_up_lora.B),
        zeros(down_lora and down_lora.A), zeros(down_lora and down_lora.B),
    )


def _store_grads(grad_a: torch.Tensor, grad_b: torch.Tensor, lora: ExpertLora, expert: int,
                 a_e: torch.Tensor, b_e: torch.Tensor) -> None:
    """Writes one expert's ``dA_e [r, in]`` and ``dB_e [out, r]`` into the PEFT-layout gradients."""
    r = lora.rank
    grad_a[expert * r : (expert + 1) * r] = a_e
    grad_b.view(grad_b.shape[0], r, lora.num_experts)[:, :, expert] = b_e


def experts_backward(
    weights: ExpertWeights,
    saved: SavedState,
    grad_out: torch.Tensor,
    gate_up_lora: ExpertLora | None,
    down_lora: ExpertLora | None,
) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
    """Gradients of :func:`experts_forward` for the hidden states, routing weights and LoRA factors.

    The base weights are frozen, so only input-side products are needed; gate/up pre-activations come from
    the forward pass instead of being recomputed.

    Returns:
        ``(grad_hidden [T, H] float32, grad_top_k_weights [T, k] float32, LoraGrads)``.
    """
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
        grad_y = grad_out[tokens].float()  # [n, H], gradient of the weighted sum
        gu = saved.gate_up_out[start:end].float()
        gate, up = gu[:, :inter], gu[:, inter:]
        act = F.silu(gate) * up  # [n, I]

        # Gradient w.r.t. act of the *unweighted* expert output; its dot with act is the routing-weight gradient.
        grad_act = grad_y @ weights.down[expert].float()  # [n, I]
        down = _expert_lora(down_lora, expert)
        if down is not None:
            _, grad_a, grad_b = _lora_input_grads(grad_y * w, act, down)
            grad_act = grad_act + (down[2] * grad_y @ down[1]) @ down[0]
            _store_grads(grads.down_A, grads.down_B, down_lora, expert, grad_a, grad_b)
        grad_routing[pairs] = (grad_act * act).sum(-1)
        grad_act = grad_act * w

        sig = torch.sigmoid(gate)
        grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))
        grad_up = grad_act * F.silu(gate)
        grad_gu = torch.cat([grad_gate, grad_up], dim=1)  # [n, 2I]
        grad_x = grad_gu @ weights.gate_up[expert].float()  # [n, H]
        gate_up = _expert_lora(gate_up_lora, expert)
        if gate_up is not None:
            part, grad_a, grad_b = _lora_input_grads(grad_gu, saved.hidden[tokens].float(), gate_up)
            grad_x = grad_x + part
            _store_grads(grads.gate_up_A, grads.gate_up_B, gate_up_lora, expert, grad_a, grad_b)
        grad_hidden.index_add_(0, tokens, grad_x)
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
