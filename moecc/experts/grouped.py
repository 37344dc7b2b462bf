"""Routed experts with LoRA as grouped matrix products: one ``torch._grouped_mm`` per projection, not a loop.

Same contract as :mod:`moecc.experts.reference` (``forward`` / ``backward``, ``SavedState``, ``LoraGrads`` in
PEFT's layouts, a subset of the experts through ``expert_mask`` / ``grouping``), so a paradigm can run either.
The (token, slot) pairs are sorted by expert once; every product then runs over the sorted rows with ``offs`` =
the int32 end of each expert's rows, which stays on the device (no host sync). Where ``_grouped_mm`` has no kernel for the dtype and device (see
:func:`available`), or a size breaks its 16-byte stride rule, the same products run as a per-expert loop.

LoRA is computed factorised, ``x W_e^T + s (x A_e^T) B_e^T``: ``W + s B A`` is never formed. HF + PEFT fold the
factors into the weight first, so this is not bit-exact with them (or with the reference): it agrees to
float32 rounding in float32 and to bf16 rounding in bf16.

Memory: forward keeps for backward only ``SavedState`` (hidden ``[T, H]`` and the pre-activations ``[P, 2I]`` in
the activation dtype, float32 routing weights ``[T, k]``, int64 grouping ``[E+1]`` and ``[P]``; P = T*k); the
activation is recomputed from the pre-activations in backward. No float32 ``[P, *]`` intermediate outlives a
call, and inside one, scalings and sums are taken in place and each stage's inputs are released once used, so
at most two float32 ``[P, H]`` tensors exist at a time.

Layouts (weights and factors as in :mod:`moecc.experts.types`):
    sorted rows  row p of every [P, *] tensor is pair ``order[p]`` (token ``order[p] // k``); expert e owns
                 rows ``offsets[e] .. offsets[e+1]``
    factors      A_e as ``[E, r8, in]``, B_e^T as ``[E, r8, out]``, in the activation dtype, rank zero-padded
                 to r8 (a multiple of 8) so the ``[P, r8]`` intermediates keep 16-byte row strides
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import reference
from .activation import activate, activation_grads, merge, split
from .grouping import Grouping, resolve
from .types import ExpertLora, ExpertWeights, LoraGrads, SavedState

_RANK_MULTIPLE = 8  # 16 bytes of bf16
_MAX_GROUPS = 1023  # PyTorch's CUTLASS grouped kernel takes fewer than 1024 groups
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _runs_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this build's CPU ``_grouped_mm`` accepts ``dtype``, tried once on a tiny problem."""
    try:
        torch._grouped_mm(torch.zeros(8, 8, dtype=dtype), torch.zeros(1, 8, 8, dtype=dtype),
                          offs=torch.tensor([8], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``torch._grouped_mm`` computes ``dtype`` on ``device`` as one kernel, with no host sync.

    CUDA: bf16 on compute capability 9.x and 10.x (H100/H200, B200), PyTorch's CUTLASS kernel; other dtypes and
    GPUs go to PyTorch's fallback, which copies the offsets to the host and loops, no better than our loop.
    CPU: the dtypes this build accepts (float32, bf16, float16 in recent PyTorch). Other devices: no.
    """
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if torch.version.hip is not None or dtype != torch.bfloat16 or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type == "cpu":
        return dtype in _CPU_DTYPES and _runs_on_cpu(dtype)
    return False


class _Groups:
    """Where each expert's rows are among the sorted pairs, and products over those rows."""

    def __init__(self, offsets: torch.Tensor, grouped: bool) -> None:
        self.offsets = offsets  # [E+1] int64
        self.ends = offsets[1:].to(torch.int32)  # [E], grouped_mm's offs
        self.grouped = grouped  # torch._grouped_mm, else a per-expert loop
        self._bounds: list[int] | None = None
        self._idle: torch.Tensor | None = None  # [E, 1, 1] bool: experts without rows, for sum_outer

    def _host_bounds(self) -> list[int]:
        """The offsets on the host, for the loop (a sync, which the grouped path never needs)."""
        if self._bounds is None:
            self._bounds = self.offsets.tolist()
        return self._bounds

    def expert_ids(self, num_rows: int) -> torch.Tensor:
        """``[P]`` the expert of each sorted row (``num_rows`` given, so no sync for the output size)."""
        experts = torch.arange(self.offsets.numel() - 1, device=self.offsets.device)
        return torch.repeat_interleave(experts, self.offsets.diff(), output_size=num_rows)

    def mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``out[p] = x[p] @ weight[e]`` for the expert e owning row p: ``[P, K] x [E, K, N] -> [P, N]``."""
        if self.grouped:
            return torch._grouped_mm(x.contiguous(), weight, offs=self.ends)
        out = x.new_zeros(x.shape[0], weight.shape[-1])
        bounds = self._host_bounds()
        for expert in range(len(bounds) - 1):
            start, end = bounds[expert], bounds[expert + 1]
            if start < end:
                out[start:end] = x[start:end] @ weight[expert]
        return out

    def sum_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out[e] = a_e^T @ b_e`` over expert e's rows (weight gradients): ``[P, M], [P, N] -> [E, M, N]``."""
        if self.grouped:
            # a^T as a column-major view: the operand order for which the kernel accepts empty groups.
            out = torch._grouped_mm(a.contiguous().T, b.contiguous(), offs=self.ends)
            # Idle experts' blocks are zeroed here rather than trusting every kernel to write them. The mask is
            # made once per grouping: each op queued costs the host thread that queues the GPU part's work.
            if self._idle is None:
                self._idle = (self.offsets.diff() == 0)[:, None, None]
            return out.masked_fill_(self._idle, 0)
        bounds = self._host_bounds()
        out = a.new_zeros(len(bounds) - 1, a.shape[1], b.shape[1])
        for expert in range(len(bounds) - 1):
            start, end = bounds[expert], bounds[expert + 1]
            if start < end:
                out[expert] = a[start:end].T @ b[start:end]
        return out


@dataclass
class _Factors:
    """One projection's LoRA, per expert, in the activation dtype (see the module docstring)."""

    a: torch.Tensor  # [E, r8, in]   A_e
    b_t: torch.Tensor  # [E, r8, out]  B_e^T
    scaling: float
    rank: int


def _factors(lora: ExpertLora | None, dtype: torch.dtype) -> _Factors | None:
    """PEFT's ``A [r*E, in]`` (expert-major) and ``B [out, r*E]`` (rank-major) regrouped per expert. A rank that
    needs no padding takes one conversion per factor (each op is host time on the thread that queues the GPU's)."""
    if lora is None:
        return None
    experts, rank = lora.num_experts, lora.rank
    padded = -(-rank // _RANK_MULTIPLE) * _RANK_MULTIPLE
    a_e = lora.A.detach().view(experts, rank, -1)
    b_e = lora.B.detach().view(-1, rank, experts).permute(2, 1, 0)  # B_e[o, j] = B[o, j*E + e]
    if padded == rank:
        b_t = torch.empty(b_e.shape, dtype=dtype, device=b_e.device).copy_(b_e)  # contiguous, whatever the dtype
        return _Factors(a_e.to(dtype), b_t, lora.scaling, rank)
    a = torch.zeros(experts, padded, lora.A.shape[1], dtype=dtype, device=lora.A.device)
    a[:, :rank] = a_e
    b_t = torch.zeros(experts, padded, lora.B.shape[0], dtype=dtype, device=lora.B.device)
    b_t[:, :rank] = b_e
    return _Factors(a, b_t, lora.scaling, rank)


def _peft_grads(lora: _Factors | None, grad_a: torch.Tensor | None,
                grad_b_t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-expert gradients ``[E, r8, in]`` / ``[E, r8, out]`` in PEFT's A and B layouts, float32."""
    if lora is None:
        return None, None
    r = lora.rank
    grad_a = grad_a[:, :r].float().reshape(-1, grad_a.shape[-1])  # [r*E, in]
    grad_b = grad_b_t[:, :r].float().permute(2, 1, 0).reshape(grad_b_t.shape[-1], -1)  # [out, r*E]
    return grad_a, grad_b


def _lora_input(groups: _Groups, x: torch.Tensor, lora: _Factors | None) -> torch.Tensor | None:
    """``u = x A_e^T`` ``[P, r8]`` in the activation dtype."""
    return None if lora is None else groups.mm(x, lora.a.transpose(1, 2))


def _project(groups: _Groups, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             lora: _Factors | None) -> torch.Tensor:
    """``x W_e^T + s (x A_e^T) B_e^T + b_e`` per sorted row, float32.

    Args:
        x: ``[P, in]`` activation dtype. weight: ``[E, in, out]`` (a view of the stored weight).
        bias: ``[P, out]`` float32 rows of each row's expert, or None.
    """
    z = groups.mm(x, weight).float()  # [P, out], a new tensor (so what follows may be in place)
    if lora is not None:
        z += groups.mm(_lora_input(groups, x, lora), lora.b_t).float().mul_(lora.scaling)
    return z if bias is None else z.add_(bias)


def _project_backward(groups: _Groups, grad_z: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor,
                      lora: _Factors | None, row_scale: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`_project` whose output gradient is ``row_scale[:, None] * grad_z``.

    ``row_scale`` (the routing weights, None for 1) is applied after the input-side product, so the caller gets
    ``grad_z @ W_eff_e`` unscaled and can also form the routing weights' gradient from it.

    Args:
        grad_z: ``[P, out]`` activation dtype. x: the forward input ``[P, in]``. weight_t: ``[E, out, in]``.
    Returns:
        ``(grad_z @ W_eff_e [P, in] float32, grad A [E, r8, in] | None, grad B^T [E, r8, out] | None)``.
    """
    grad_x = groups.mm(grad_z, weight_t).float()  # [P, in], a new tensor
    if lora is None:
        return grad_x, None, None
    dtype = grad_z.dtype
    grad_u = groups.mm(grad_z, lora.b_t.transpose(1, 2)).float() * lora.scaling  # [P, r8]
    grad_x.add_(groups.mm(grad_u.to(dtype), lora.a))  # float32 += the product's values, with no float copy
    if row_scale is not None:
        grad_u = grad_u * row_scale[:, None]
        grad_z = (grad_z * row_scale[:, None]).to(dtype)  # computed in float32 (type promotion)
    grad_a = groups.sum_outer(grad_u.to(dtype), x)  # [E, r8, in]
    grad_b_t = groups.sum_outer(_lora_input(groups, x, lora), grad_z).float() * lora.scaling  # [E, r8, out]
    return grad_x, grad_a, grad_b_t


def _use_grouped(weights: ExpertWeights, dtype: torch.dtype, device: torch.device, num_rows: int) -> bool:
    """``_grouped_mm`` where it runs and every operand meets its 16-byte stride rule; the loop otherwise."""
    align = 16 // dtype.itemsize
    dense = all(w.dtype != dtype or (w.is_contiguous() and w.data_ptr() % 16 == 0)
                for w in (weights.gate_up, weights.down))
    return (num_rows > 0 and dense and weights.num_experts <= _MAX_GROUPS
            and weights.hidden_size % align == 0 and weights.intermediate_size % align == 0
            and available(dtype, device))


def _forward_weights(weights: ExpertWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [E, H, 2I], down [E, I, H])``: views (input dimension first) in the activation dtype."""
    gate_up, down = weights.gate_up.to(dtype), weights.down.to(dtype)
    if weights.transposed:
        return gate_up, down
    return gate_up.transpose(1, 2), down.transpose(1, 2)


def _bias_rows(bias: torch.Tensor | None, expert_ids: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()[expert_ids]  # [P, out]


def _activation(gate_up: torch.Tensor, weights: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """``[P, I]`` in ``dtype`` from the pre-activations ``[P, 2I]`` (their float32 copy is freed on return)."""
    gate, up = split(gate_up.float(), weights.interleaved)
    return activate(gate, up, weights, dtype, as_dtype=True)


def _per_pair(rows: torch.Tensor, order: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """Sorted rows ``[P, ...]`` put back in pair order ``[T*k, ...]``; pairs outside a subset are zero."""
    per_pair = torch.empty_like(rows) if order.numel() == num_pairs else rows.new_zeros(num_pairs, *rows.shape[1:])
    return per_pair.index_copy_(0, order, rows)


def _sum_per_token(rows: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``[T, H]``: sorted rows put back in pair order and summed over each token's k slots (deterministic)."""
    per_pair = _per_pair(rows, order, num_tokens * top_k)  # [T*k, H]
    return per_pair.view(num_tokens, top_k, rows.shape[-1]).sum(dim=1)


# Stateless as the reference, and for every layout (the loop runs where ``_grouped_mm`` does not).
supports, release_result, prepare_layers = reference.supports, reference.release_result, reference.prepare_layers
keep_experts = reference.keep_experts


def forward(weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None, *, expert_mask: torch.Tensor | None = None,
            grouping: Grouping | None = None) -> tuple[torch.Tensor, SavedState]:
    """``y[t] = sum_j w[t,j] * down_e(act(gate_e(x[t]), up_e(x[t])))`` with ``e = top_k_index[t,j]``, the sum
    over the pairs of the experts in ``expert_mask`` / ``grouping`` when given (see ``ExpertBackend``).

    Args:
        hidden: ``[T, H]``. top_k_index: ``[T, k]`` int. top_k_weights: ``[T, k]`` float. Weights, LoRA
            factors and activations on one device.
    Returns:
        ``(y [T, H] in hidden's dtype, state for backward)``.
    """
    num_tokens, top_k = top_k_index.shape
    dtype = hidden.dtype
    grouping = resolve(top_k_index, weights.num_experts, expert_mask, grouping)
    offsets, order = grouping.offsets, grouping.order
    groups = _Groups(offsets, _use_grouped(weights, dtype, hidden.device, order.numel()))
    has_bias = weights.gate_up_bias is not None or weights.down_bias is not None
    expert_ids = groups.expert_ids(order.numel()) if has_bias else None
    gate_up_w, down_w = _forward_weights(weights, dtype)
    gate_up = _project(groups, hidden[order // top_k], gate_up_w, _bias_rows(weights.gate_up_bias, expert_ids),
                       _factors(gate_up_lora, dtype)).to(dtype)  # [P, 2I], kept pre-activation
    y = _project(groups, _activation(gate_up, weights, dtype), down_w, _bias_rows(weights.down_bias, expert_ids),
                 _factors(down_lora, dtype))  # [P, H] float32
    routing = top_k_weights.float().reshape(-1)[order]  # [P]
    out = _sum_per_token(y.mul_(routing[:, None]), order, num_tokens, top_k)  # [T, H] float32
    saved = SavedState(hidden.clone(), top_k_weights.float().clone(), offsets, order, gate_up,
                       top_k_weights.dtype)
    return out.to(dtype), saved


def backward(weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor, gate_up_lora: ExpertLora | None,
             down_lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
    """Gradients of :func:`forward` for the hidden states, routing weights and LoRA factors, over the experts
    forward computed (zeros elsewhere).

    Returns:
        ``(grad_hidden [T, H], grad_top_k_weights [T, k], LoraGrads)``, float32.
    """
    dtype, order = saved.hidden.dtype, saved.order
    num_tokens, top_k = saved.top_k_weights.shape
    if order.numel() == 0:
        return (grad_out.new_zeros(grad_out.shape, dtype=torch.float32),
                saved.top_k_weights.new_zeros(num_tokens, top_k), LoraGrads.zeros(gate_up_lora, down_lora))
    groups = _Groups(saved.offsets, _use_grouped(weights, dtype, saved.hidden.device, order.numel()))
    gate_up_lora_e, down_lora_e = _factors(gate_up_lora, dtype), _factors(down_lora, dtype)
    gate_up_w, down_w = _forward_weights(weights, dtype)
    tokens = order // top_k
    routing = saved.top_k_weights.reshape(-1)[order]  # [P]
    gate, up = split(saved.gate_up_out.float(), weights.interleaved)
    act = activate(gate, up, weights, dtype, as_dtype=True)  # [P, I]
    grad_z = grad_out[tokens].to(dtype)  # [P, H], gradient of each pair's output before its routing weight

    grad_act, grad_down_a, grad_down_b_t = _project_backward(groups, grad_z, act, down_w.transpose(1, 2),
                                                             down_lora_e, row_scale=routing)  # [P, I]
    # d(w * y)/dw = grad_z . y, and grad_z . (act W_eff^T + b) = (grad_z W_eff) . act + grad_z . b.
    grad_routing = (grad_act * act).sum(-1)  # [P], float32
    if weights.down_bias is not None:
        down_bias = _bias_rows(weights.down_bias, groups.expert_ids(order.numel()))
        grad_routing = grad_routing + (grad_z.float() * down_bias).sum(-1)
    del act, grad_z  # done with: the gate/up projection's backward below is the peak
    grad_gate, grad_up = activation_grads(grad_act * routing[:, None], gate, up, weights, dtype, as_dtype=True)
    del gate, up, grad_act
    grad_gate_up = merge(grad_gate, grad_up, weights.interleaved)  # [P, 2I]
    del grad_gate, grad_up

    grad_x, grad_gate_up_a, grad_gate_up_b_t = _project_backward(
        groups, grad_gate_up, saved.hidden[tokens], gate_up_w.transpose(1, 2), gate_up_lora_e)  # [P, H]
    grad_hidden = _sum_per_token(grad_x, order, num_tokens, top_k)
    grad_routing = _per_pair(grad_routing, order, num_tokens * top_k).view(num_tokens, top_k)
    grads = LoraGrads(*_peft_grads(gate_up_lora_e, grad_gate_up_a, grad_gate_up_b_t),
                      *_peft_grads(down_lora_e, grad_down_a, grad_down_b_t))
    return grad_hidden, grad_routing, grads
