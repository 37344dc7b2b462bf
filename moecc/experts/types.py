"""Value types every expert backend takes and returns, and the protocol a backend implements.

Layouts (Hugging Face fused experts, PEFT ``target_parameters`` LoRA):
    gate_up  [E, 2I, H]   rows [0, I) are the gate projection, [I, 2I) the up projection
    down     [E, H, I]
    lora A   [r*E, in]    expert e uses rows e*r .. (e+1)*r          (expert-major)
    lora B   [out, r*E]   expert e uses columns e, e+E, e+2E, ...    (rank-major)
    pairs    pair p is (token p // k, slot p % k) of the ``[T, k]`` routing
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .grouping import Grouping


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
    """Frozen base weights of one MoE layer's routed experts, in the model's own layout.

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
    # Frozen weights held in a quantized format (``moecc.experts.formats.QuantizedMatrices``, in the kernels'
    # orientation [E, N out, K in] whatever ``transposed`` says); ``gate_up`` / ``down`` are then placeholders that
    # keep the model's shapes and dtype but hold no values (one copy in host memory: the quantized one).
    gate_up_q: object | None = None
    down_q: object | None = None

    @property
    def format(self) -> str:
        """``"int8"``, ``"int4"``, ``"fp8"``, ``"mxfp4"``, or the dtype's name (``"bfloat16"``) when not quantized."""
        return self.gate_up_q.format if self.gate_up_q is not None else str(self.gate_up.dtype).removeprefix("torch.")

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
    """What backward needs from forward (on the device the forward ran on).

    ``offsets`` / ``order`` are the grouping forward computed, so backward computes the same experts: all of
    them, or the subset forward was given (then ``order`` holds only that subset's pairs).
    """

    hidden: torch.Tensor  # [T, H] activation dtype
    top_k_weights: torch.Tensor  # [T, k] float32
    offsets: torch.Tensor  # [E+1] int64
    order: torch.Tensor  # [P] int64, pair ids grouped by expert (P = T*k without a subset)
    gate_up_out: torch.Tensor  # [P, 2I] activation dtype, pre-activation, in grouped order
    weights_dtype: torch.dtype = torch.float32  # dtype the routing weights arrived in
    # The native kernels' LoRA inner products (x A_gu, act A_down: [P, r] float32, grouped order, None where a
    # projection has no LoRA), which their backward reuses; None for the other backends
    lora_inner: tuple | None = None

    @property
    def grouping(self) -> Grouping:
        return Grouping(self.offsets, self.order)


@dataclass
class LoraGrads:
    """Gradients of one layer's expert LoRA factors, float32, same layouts as the factors."""

    gate_up_A: torch.Tensor | None
    gate_up_B: torch.Tensor | None
    down_A: torch.Tensor | None
    down_B: torch.Tensor | None

    @classmethod
    def zeros(cls, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> LoraGrads:
        """Zero gradients shaped like the factors (None where a projection has no LoRA)."""

        def zeros(lora: ExpertLora | None, name: str) -> torch.Tensor | None:
            factor = None if lora is None else getattr(lora, name)
            return None if factor is None else torch.zeros(factor.shape, dtype=torch.float32, device=factor.device)

        return cls(zeros(gate_up_lora, "A"), zeros(gate_up_lora, "B"), zeros(down_lora, "A"), zeros(down_lora, "B"))


@dataclass
class PairGrads:
    """Host tensors a subset's backward writes its results into (``NativeExperts.backward_pairs_into``): the input
    gradient as rows ``[P, H]``, bf16 (or float32), with their tokens ``[P]`` int64 (summed at those tokens it is the
    subset's ``grad_hidden``), the routing-weight gradient ``[T, k]`` float32, and the LoRA gradients of the
    experts ``lora_experts`` (``[n]`` int64, distinct) alone, in that order: per factor (gate/up A, B, down A, B;
    None where a projection has no LoRA) A's blocks ``[n, r, in]`` and B's ``[out, r, n]``, float32."""

    rows: torch.Tensor
    tokens: torch.Tensor
    grad_weights: torch.Tensor
    lora_experts: torch.Tensor
    lora_blocks: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class ExpertBackend(Protocol):
    """What every expert-math backend provides (``moecc.experts.reference``, ``.grouped``, ``.native``).

    A subset of the layer's experts is given either as ``expert_mask`` (bool ``[E]``) or as a ``grouping`` made
    by :func:`moecc.experts.group_by_expert` (``.subset(mask)`` of the layer's full grouping); only those
    experts' routed pairs are computed. Outputs are then partial: ``out`` and ``grad_hidden`` sum over the
    subset's pairs only, ``grad_top_k_weights`` is zero for pairs outside it and LoRA gradients are zero for
    experts outside it, so the results over a partition of the experts sum to the full result.
    """

    def supports(self, weights: ExpertWeights) -> bool:
        """Whether this backend runs a layer with these weights (dtype, layout)."""

    def forward(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None, *,
                expert_mask: torch.Tensor | None = None,
                grouping: Grouping | None = None) -> tuple[torch.Tensor, SavedState]:
        """``(out [T, H] in hidden's dtype, state for backward)``."""

    def backward(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                 gate_up_lora: ExpertLora | None,
                 down_lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
        """``(grad_hidden [T, H], grad_top_k_weights [T, k], LoraGrads)`` for the experts forward computed."""

    def release_result(self, tensor: torch.Tensor) -> None:
        """Hands back an output or input gradient once the caller is done with it (a no-op unless pooled)."""

    def prepare_layers(self, weights: list[ExpertWeights]) -> None:
        """Called once ``moecc.prepare`` has built every layer (the native kernels pack weights here)."""


@runtime_checkable
class PairRowsBackend(ExpertBackend, Protocol):
    """A CPU backend that can hand a subset's results back as one row per routed pair (``rows_pay``), for the
    device to add where the pairs' tokens are, and can write them into the caller's buffers itself (hybrid's CPU
    part: ``moecc.experts.native``; ``.select.PerLayerExperts``). Checked once, when an engine is built."""

    @property
    def fresh_bytes(self) -> int:
        """Bytes of new host buffers allocated so far (a call during which this grew paid first-touch faults)."""

    def returns_rows(self, weights: ExpertWeights) -> bool:
        """Whether :meth:`forward_pairs` can return rows per pair for this layer."""

    def forward_pairs(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None,
                      *, expert_mask: torch.Tensor) -> tuple:
        """``(out [T, H] or rows [P, H], tokens [P] or None, saved)``."""

    def forward_pairs_into(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None,
                           down_lora: ExpertLora | None, *, expert_mask: torch.Tensor, rows: torch.Tensor,
                           tokens: torch.Tensor, weights_out: torch.Tensor | None = None) -> SavedState:
        """:meth:`forward_pairs`'s rows written into ``rows`` / ``tokens`` (bf16 rows before their routing
        weights, which go to ``weights_out``); returns the saved state."""

    def backward_pairs(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                       gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> tuple:
        """``(grad_hidden or rows, tokens or None, grad_top_k_weights, LoraGrads)``."""

    def backward_pairs_into(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                            gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None,
                            out: PairGrads) -> None:
        """:meth:`backward_pairs` of a subset whose input gradient leaves as rows, written into ``out``."""

    def keep_experts(self, weights: ExpertWeights, saved: SavedState, experts) -> SavedState:
        """``saved`` with only ``experts``' pairs (their backward runs here; the others' moved)."""

    def release(self, saved: SavedState) -> None:
        """Hands a forward's saved buffers back when no backward will consume them."""
