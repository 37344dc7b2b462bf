"""The native CPU expert backend: ``forward`` / ``backward`` with the same contract as
``moecc.experts.reference``, computed by the C++ kernels on the model's own bf16 weights or on their quantized copy
(``ExpertWeights.gate_up_q`` / ``down_q``: int8, int4, fp8, mxfp4): each product task packs the slice it needs
into per-thread scratch, dequantizing it first where the weights are quantized, so no second copy of the experts
is kept.

A subset of the experts runs as a problem of its own: each of the subset's pairs becomes a token with one slot
(its hidden row gathered, its routing weight kept), so the kernels see a complete routing of only those pairs and
do no work for the other experts; the float32 rows are then summed into their tokens.

Supports the standard layout (``gate_up [E, 2I, H]``, ``down [E, H, I]``, SwiGLU, no biases) with bf16 weights
(or a bf16 model's quantized ones) and activations; anything else raises ``UnsupportedModelError`` naming the
reference backend as the way out.
Numerics: bf16 operands, float32 accumulation, LoRA computed factorised in float32 (not folded into the
weight as PEFT does), so results agree with the reference to bf16 tolerance, not bit for bit.
"""
from __future__ import annotations

import os
import threading
import weakref
import warnings
from dataclasses import dataclass

import torch

from .. import _ops
from ..errors import MoeccError, UnsupportedModelError
from .grouping import Grouping, is_full, kept_rows, resolve
from .types import ExpertLora, ExpertWeights, LoraGrads, PairGrads, SavedState


def _kernel_lora(lora: ExpertLora | None) -> tuple | None:
    """PEFT's ``A [r*E, in]``, ``B [out, r*E]`` as the kernels take them: ``A`` viewed ``[E, r, in]``, both
    float32 and contiguous (no copy for PEFT's usual float32 adapters; the kernels re-lay B themselves)."""
    if lora is None:
        return None
    experts, rank = lora.num_experts, lora.rank
    a, b = (t if t.dtype == torch.float32 and t.is_contiguous() else t.detach().float().contiguous()
            for t in (lora.A, lora.B))
    return a.view(experts, rank, -1), b, lora.scaling


def _kernel_grads(grads: tuple | None, lora: ExpertLora | None) -> tuple | None:
    """LoRA gradient buffers ``(dA [r*E, in], dB [out, r*E])`` as the kernels write them: ``dA`` viewed
    ``[E, r, in]``."""
    if grads is None:
        return None
    return grads[0].view(lora.num_experts, lora.rank, -1), grads[1]


def _inner_for(saved: SavedState, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None) -> tuple | None:
    """The forward's LoRA inner products where they fit the factors backward is given (same ranks; otherwise the
    kernel recomputes them), else None."""
    if saved.lora_inner is None:
        return None
    return tuple(inner if inner is not None and lora is not None and inner.shape[1] == lora.rank else None
                 for inner, lora in zip(saved.lora_inner, (gate_up_lora, down_lora)))


@dataclass
class _SubsetState(SavedState):
    """A subset's saved state: the kernels' own problem (one slot per pair) and where its rows came from."""

    pair_ids: torch.Tensor | None = None  # [P] the pair id (token * k + slot) of each of the problem's tokens
    routing_shape: tuple[int, int] = (0, 0)  # (T, k) of the layer's routing


class _BufferPool:
    """Host buffers handed from one call to the next.

    Hundreds of MB per layer of freshly allocated memory cost a page fault per 4 KB on first touch, and the
    faults of many threads serialise in the kernel: at 8192 tokens that was most of the gate/up product's time.
    Saved state (gate/up outputs, hidden-state copies, LoRA inner products) lives from a layer's forward to its
    backward, then returns here for the next step's forward; the pool never holds more buffers than were alive
    at once.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        # The tensors take() handed out and give() has not had back, weakly (one its caller drops just goes): give()
        # pools only these very objects, so a foreign tensor, or one given back twice (its pages meanwhile lent
        # again as another tensor), never reaches two callers at once.
        self._lent: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # forwards run on the engine's worker thread, backwards on autograd's
        self.fresh_bytes = 0  # bytes of new buffers allocated so far (each costs its page faults on first touch)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        with self._lock:
            fitting = [b for b in self._free if b.dtype == dtype and b.numel() >= numel]
            if fitting:
                buffer = min(fitting, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not buffer]
            else:
                too_small = [b for b in self._free if b.dtype == dtype]
                if too_small:  # outgrown: let the largest go, so the pool does not fill with unusable buffers
                    largest = max(too_small, key=torch.Tensor.numel)
                    self._free = [b for b in self._free if b is not largest]
                buffer = None
                self.fresh_bytes += numel * dtype.itemsize
        if buffer is None:
            buffer = torch.empty(numel, dtype=dtype)
        lent = buffer[:numel].view(shape)  # a view: its _base is the buffer
        with self._lock:
            self._lent[id(lent)] = lent
        return lent

    def give(self, tensor: torch.Tensor) -> None:
        """Takes back a tensor take() handed out; anything else (or a second give) is ignored."""
        with self._lock:
            if self._lent.get(id(tensor)) is tensor:
                del self._lent[id(tensor)]
                self._free.append(tensor._base)


OMP_WAIT_POLICY_ADVICE = (
    "moecc: torch was imported before moecc with OMP_WAIT_POLICY unset, so torch's OpenMP threads busy-wait after "
    "each CPU op on the cores moecc's expert kernels use, slowing them (on a 16-core Xeon a 256-token layer's "
    "backward took 66 ms instead of 37). Import moecc before torch, or start Python with OMP_WAIT_POLICY=PASSIVE "
    "in its environment "
    "(setting it later in the process has no effect; OMP_WAIT_POLICY=ACTIVE keeps the spinning and silences this)."
)


def _check_omp_wait_policy() -> None:
    """Warns when torch's OpenMP threads will spin (Python shows it once per calling line); see
    ``moecc/__init__.py``."""
    if not os.environ.get("OMP_WAIT_POLICY"):
        warnings.warn(OMP_WAIT_POLICY_ADVICE, RuntimeWarning, stacklevel=3)


def _available_host_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable (Linux), or less where a cgroup v2 memory limit
    (a container) leaves less; None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as used:
            cap = limit.read().strip()
            if cap != "max":
                left = int(cap) - int(used.read().strip())
                available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def rows_pay(pairs: int, tokens: int) -> bool:
    """Whether a subset's results leave as rows per pair rather than summed ``[T, H]``: up to two pairs a token (at
    most 4x the dense bf16 bytes as float32 rows, 2x as the bf16 rows hybrid's published parts hand over, to stage
    and for the device to read across PCIe)."""
    return pairs <= 2 * tokens


class NativeExperts:
    """Runs the kernels on each layer's weights as they are now (so PEFT merges are seen at once)."""

    def __init__(self, isa: str, prepack: bool = False, tuning: _ops.KernelTuning | None = None) -> None:
        """``isa``: the kernel variant. ``prepack`` (``MoeccConfig.prepack_weights``): keep a copy of each
        layer's weights in the kernels' panel layout, which the forward products read instead of packing per
        task (it doubles the experts' host memory), off by default. ``tuning``: the kernels' task shape and
        store settings (None: the defaults; benchmarks and tests set others, also later through ``tuning``)."""
        _ops.check_isa(isa)
        _check_omp_wait_policy()
        self.isa = isa
        self.prepack = prepack
        self.tuning = tuning
        self._saved_buffers = _BufferPool()  # saved state's buffers, forward to backward
        self._scratch = _BufferPool()  # float32 results, converted before they leave this object
        # bf16 outputs, input gradients and float32 LoRA gradients, handed back through release_result
        self._results = _BufferPool()

    @property
    def fresh_bytes(self) -> int:
        """Bytes of new host buffers this backend's pools allocated so far: a call during which it grew paid the
        page faults of first touch, which the calls after it do not (the hybrid cost fit leaves such calls out)."""
        return self._saved_buffers.fresh_bytes + self._scratch.fresh_bytes + self._results.fresh_bytes

    @staticmethod
    def supports(weights: ExpertWeights) -> bool:
        """Whether the kernels run this layer: bf16 SwiGLU experts in the standard layout, no biases, their weights
        bf16 or quantized in a format the kernels read."""
        return not (weights.transposed or weights.interleaved or weights.gate_up_bias is not None
                    or weights.down_bias is not None or weights.swiglu_limit is not None
                    or weights.gate_up.dtype != torch.bfloat16 or weights.down.dtype != torch.bfloat16
                    or any(q is not None and q.format not in _ops.WEIGHT_FORMATS
                           for q in (weights.gate_up_q, weights.down_q)))

    def returns_rows(self, weights: ExpertWeights) -> bool:
        """Whether :meth:`forward_pairs` can return rows per pair for this layer (a subset within ``rows_pay``)."""
        return self.supports(weights)

    def _matrices(self, weights: ExpertWeights) -> tuple:
        """The layer's own weights, which the kernels read in place (no copy is kept): per projection its bf16
        tensor, or its ``QuantizedMatrices`` where it is quantized (the bf16 tensor then only holds the shape)."""
        if not self.supports(weights):
            raise UnsupportedModelError(
                "the native CPU expert kernels run bf16 SwiGLU experts in the standard layout, their weights bf16 or "
                f"quantized ({', '.join(_ops.WEIGHT_FORMATS)}); this model has {weights.format} experts or "
                "gpt-oss-style experts. Use MOECC_BACKEND=reference"
            )
        return tuple(tensor.detach().contiguous() if quantized is None else quantized
                     for tensor, quantized in ((weights.gate_up, weights.gate_up_q), (weights.down, weights.down_q)))

    def _refuse_prepack_of_quantized(self, weights: ExpertWeights) -> None:
        if weights.gate_up_q is not None or weights.down_q is not None:
            raise MoeccError(
                f"prepack_weights keeps a bf16 copy of the experts in the kernels' panel layout, but this layer's "
                f"experts are held in {weights.format}: the copy would take twice their bf16 size on top of them. "
                "Set prepack_weights=False (MOECC_PREPACK_WEIGHTS=0); quantized experts are dequantized slice by "
                "slice as the kernels pack them"
            )

    def prepare_layers(self, weights: list[ExpertWeights]) -> None:
        """Makes the packed copies of the layers the kernels run (under ``prepack``), with a progress bar, after
        checking that host memory holds them (the copies are as large as the weights); quantized layers refuse
        ``prepack``."""
        weights = [w for w in weights if self.supports(w)]
        if not self.prepack or not weights:
            return
        for layer_weights in weights:
            self._refuse_prepack_of_quantized(layer_weights)
        needed = sum(_ops.packed_nbytes(w.gate_up) + _ops.packed_nbytes(w.down) for w in weights)
        available = _available_host_bytes()
        if available is not None and needed > 0.9 * available:
            raise MoeccError(
                f"prepack_weights needs {needed / 1e9:.1f} GB of host memory for a packed copy of the experts, "
                f"{available / 1e9:.1f} GB is available; set prepack_weights=False (MOECC_PREPACK_WEIGHTS=0)"
            )
        from tqdm import tqdm

        for layer_weights in tqdm(weights, desc="packing expert weights", unit="layer"):
            self._packed(layer_weights, self._matrices(layer_weights))

    def _packed(self, weights: ExpertWeights, matrices: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weights in panel layout under ``prepack``, made once per weight tensors and revision (PEFT merges
        and in-place writes, ``ExpertLayer.revision``) and kept on the weights' ``cache_owner`` (None without
        prepack, or without an owner to keep them on)."""
        owner = weights.cache_owner
        if not self.prepack or owner is None:
            return None
        self._refuse_prepack_of_quantized(weights)
        key = (self.isa, matrices[0].data_ptr(), matrices[1].data_ptr(), weights.revision)
        cached = getattr(owner, "_moecc_packed", None)
        if cached is None or cached[0] != key:
            cached = (key, tuple(_ops.pack_expert_weights(self.isa, m) for m in matrices))
            owner._moecc_packed = cached
        return cached[1]

    def forward(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None, *,
                expert_mask: torch.Tensor | None = None,
                grouping: Grouping | None = None) -> tuple[torch.Tensor, SavedState]:
        """See ``moecc.experts.ExpertBackend``; ``hidden [T, H]`` and the routing in host memory."""
        loras = (gate_up_lora, down_lora)
        grouping = resolve(top_k_index, weights.num_experts, expert_mask, grouping)
        if not is_full(grouping, top_k_index):
            return self._forward_subset(weights, hidden, top_k_weights, loras, grouping)
        return self._forward(weights, hidden, top_k_weights, loras, grouping, hidden.dtype, copy_hidden=True)

    def forward_pairs(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None,
                      *, expert_mask: torch.Tensor | None = None,
                      grouping: Grouping | None = None) -> tuple[torch.Tensor, torch.Tensor | None, SavedState]:
        """:meth:`forward` with a subset's output left as one float32 row per routed pair: ``(rows [P, H], tokens
        [P], saved)``, the output being ``zeros [T, H]`` with ``rows`` added at ``tokens``. Summing on the CPU
        zeroes and rewrites all T rows however few pairs the subset has; the caller can sum on its own device.
        All the pairs, or more than ``rows_pay`` allows: ``(out [T, H], None, saved)`` as :meth:`forward`. Give
        ``rows`` back with :meth:`release_result`."""
        loras = (gate_up_lora, down_lora)
        grouping = resolve(top_k_index, weights.num_experts, expert_mask, grouping)
        if is_full(grouping, top_k_index):
            out, saved = self._forward(weights, hidden, top_k_weights, loras, grouping, hidden.dtype, copy_hidden=True)
            return out, None, saved
        if not rows_pay(grouping.num_pairs, top_k_index.shape[0]):
            out, saved = self._forward_subset(weights, hidden, top_k_weights, loras, grouping)
            return out, None, saved
        return self._subset_rows(weights, hidden, top_k_weights, loras, grouping)

    def forward_pairs_into(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, gate_up_lora: ExpertLora | None,
                           down_lora: ExpertLora | None, *, expert_mask: torch.Tensor, rows: torch.Tensor,
                           tokens: torch.Tensor, weights_out: torch.Tensor | None = None) -> SavedState:
        """:meth:`forward_pairs` of a subset whose output leaves as rows, written into the caller's ``rows [P, H]``
        and ``tokens [P]`` int64 (staging buffers the device reads, say): the kernel writes the rows there itself,
        so nothing is copied afterwards. Returns the saved state. ``rows`` float32: :meth:`forward_pairs`' rows,
        weighted. ``rows`` bf16: each pair's expert output before its routing weight, as the kernels round it, with
        the weights (float32) in ``weights_out [P]``: ``rows.float() * weights_out[:, None]`` is the float32 rows bit
        for bit, in half the bytes for the device to read across PCIe."""
        grouping = resolve(top_k_index, weights.num_experts, expert_mask, None)
        pairs = grouping.num_pairs
        if is_full(grouping, top_k_index) or not rows_pay(pairs, top_k_index.shape[0]):
            raise ValueError(f"forward_pairs_into needs a subset whose output leaves as rows; this one has {pairs} "
                             f"of {top_k_index.numel()} pairs; use forward_pairs")
        shape = (pairs, weights.hidden_size)
        if (tuple(rows.shape) != shape or rows.dtype not in (torch.float32, torch.bfloat16)
                or not rows.is_contiguous()
                or tuple(tokens.shape) != (pairs,) or tokens.dtype != torch.int64 or not tokens.is_contiguous()):
            raise ValueError(f"forward_pairs_into: rows must be float32 or bf16 {list(shape)} and tokens int64 "
                             f"[{pairs}], both contiguous; got {rows.dtype} {list(rows.shape)} and {tokens.dtype} "
                             f"{list(tokens.shape)}")
        unweighted = rows.dtype == torch.bfloat16
        if unweighted != (weights_out is not None) or (unweighted and (
                tuple(weights_out.shape) != (pairs,) or weights_out.dtype != torch.float32
                or not weights_out.is_contiguous())):
            raise ValueError(f"forward_pairs_into: bf16 rows need weights_out, float32 [{pairs}] contiguous, and "
                             f"float32 rows none; got {rows.dtype} rows and weights_out "
                             f"{None if weights_out is None else (weights_out.dtype, list(weights_out.shape))}")
        return self._subset_rows(weights, hidden, top_k_weights, (gate_up_lora, down_lora), grouping,
                                 into=(rows, tokens, weights_out))[2]

    def _forward_subset(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                        loras: tuple, grouping: Grouping) -> tuple[torch.Tensor, SavedState]:
        out_rows, tokens, saved = self._subset_rows(weights, hidden, top_k_weights, loras, grouping)
        return self._summed_rows(out_rows, tokens, tuple(hidden.shape), hidden.dtype), saved

    def _subset_rows(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                     loras: tuple, grouping: Grouping,
                     into: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, SavedState]:
        """The subset's pairs as tokens of one slot each, in grouped order (so the order is the identity):
        (float32 rows [P, H] from the scratch pool, their tokens [P], saved); ``into``: (rows, tokens, weights_out)
        to write them into instead (:meth:`forward_pairs_into`)."""
        top_k = top_k_weights.shape[1]
        pair_ids = grouping.order  # [P]
        tokens = torch.div(pair_ids, top_k, rounding_mode="floor", out=None if into is None else into[1])
        rows = self._saved_buffers.take((pair_ids.numel(), weights.hidden_size), torch.bfloat16)  # [P, H]
        torch.index_select(hidden.to(torch.bfloat16), 0, tokens, out=rows)
        routing = top_k_weights.reshape(-1)[pair_ids].view(-1, 1)  # [P, 1]
        local = Grouping(grouping.offsets, torch.arange(pair_ids.numel(), dtype=torch.int64))
        unweighted = into is not None and into[2] is not None
        if unweighted:
            into[2].copy_(routing.view(-1))
        out_rows, saved = self._forward(weights, rows, routing, loras, local, None, copy_hidden=False,
                                        into=None if into is None else into[0], unweighted=unweighted)
        saved = _SubsetState(**vars(saved), pair_ids=pair_ids, routing_shape=tuple(top_k_weights.shape))
        return out_rows, tokens, saved

    def _summed_rows(self, rows: torch.Tensor, tokens: torch.Tensor, shape: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor:
        """A subset's float32 ``rows`` (a scratch buffer, given back) summed into their ``tokens``: ``[T, H]`` in
        ``dtype``, from the results pool for bf16. Pooled buffers: fresh ones page-fault on every call (on the
        host the zero-fills of fresh pages were a subset call's largest fixed cost)."""
        acc = self._scratch.take(shape, torch.float32).zero_().index_add_(0, tokens, rows)
        self._scratch.give(rows)
        out = (self._results.take(shape, torch.bfloat16).copy_(acc) if dtype == torch.bfloat16
               else acc.to(dtype, copy=True))
        self._scratch.give(acc)
        return out

    def _forward(self, weights: ExpertWeights, hidden: torch.Tensor, top_k_weights: torch.Tensor, loras: tuple,
                 grouping: Grouping, out_dtype: torch.dtype | None, copy_hidden: bool,
                 into: torch.Tensor | None = None, unweighted: bool = False) -> tuple[torch.Tensor, SavedState]:
        """The kernels on ``grouping`` (every pair of ``top_k_weights [T, k]``); ``copy_hidden``: ``hidden`` is the
        caller's buffer, so what backward keeps is a copy. ``out_dtype`` None: the float32 scratch buffer itself,
        which the caller gives back, or ``into`` (``[T, H]``, the caller's) where given. ``unweighted``: the output
        sums the pairs without their routing weights (one pair a token: each expert's output as it is), which
        backward still gets."""
        gate_up_lora, down_lora = loras
        matrices = self._matrices(weights)
        shape = (weights.num_experts, weights.hidden_size, weights.intermediate_size)
        offsets, order = grouping.offsets, grouping.order
        hidden_bf16 = hidden.to(torch.bfloat16).contiguous()
        routing = (torch.ones(top_k_weights.numel()) if unweighted
                   else top_k_weights.float().reshape(-1).contiguous())
        tokens, top_k = top_k_weights.shape
        gate_up_out = self._saved_buffers.take((tokens * top_k, 2 * shape[2]), torch.bfloat16)
        # A bf16 output comes straight from the kernel; others through a float32 buffer.
        direct = out_dtype == torch.bfloat16
        out = (into if into is not None else self._results.take((tokens, shape[1]), torch.bfloat16) if direct
               else self._scratch.take((tokens, shape[1]), torch.float32))
        # The caller's buffer (a staging view, reused by the next layer): backward gets a copy, which the kernel
        # makes as it reads the rows.
        hidden_copy = (self._saved_buffers.take(tuple(hidden.shape), torch.bfloat16)
                       if hidden_bf16 is hidden and copy_hidden else None)
        # The LoRA inner products, kept for backward (512 bytes per token at r = 8, k = 8) so it need not redo them
        lora_inner = tuple(None if lora is None
                           else self._saved_buffers.take((tokens * top_k, lora.rank), torch.float32)
                           for lora in (gate_up_lora, down_lora))
        try:
            _ops.expert_ffn_forward(self.isa, matrices, shape, top_k, hidden_bf16, offsets, order, routing,
                                    _kernel_lora(gate_up_lora), _kernel_lora(down_lora), out=out,
                                    gate_up_out=gate_up_out, hidden_copy=hidden_copy,
                                    packed=self._packed(weights, matrices), lora_inner=lora_inner,
                                    tuning=self.tuning)
            result = out if direct or out_dtype is None else out.to(out_dtype, copy=True)
        except BaseException:
            self._scratch.give(out)
            raise
        if not direct and out_dtype is not None:
            self._scratch.give(out)
        if hidden_copy is not None:
            hidden_bf16 = hidden_copy
        saved = SavedState(hidden_bf16, top_k_weights.float().clone(), offsets, order, gate_up_out,
                           top_k_weights.dtype, lora_inner)
        return result, saved

    def release_result(self, tensor: torch.Tensor) -> None:
        """Hands back a bf16 output of :meth:`forward`, or an input gradient or LoRA gradient (a ``LoraGrads``
        field itself, not a view of it) of :meth:`backward`, once the caller is done with it (co-compute: once it
        is copied to the device), so a later call writes into the same pages instead of page-faulting fresh ones
        (a [T, H] bf16 tensor: 33.5 MB at 8192 tokens for Qwen3-30B-A3B; a layer's LoRA gradients: 26 MB at r = 8).
        The tensor must not be used afterwards: a later call overwrites it. Tensors this object did not hand out,
        and a second release of one, are ignored.
        """
        self._results.give(tensor)
        self._scratch.give(tensor)  # a float32 row block of forward_pairs / backward_pairs

    def release(self, saved: SavedState) -> None:
        """Hands a forward's saved buffers back for reuse when no backward will consume them."""
        if saved.gate_up_out is not None:
            self._give_back(saved)

    def keep_experts(self, weights: ExpertWeights, saved: SavedState, experts) -> SavedState:
        """A subset's ``saved`` (of :meth:`forward_pairs` or a masked :meth:`forward`) with only ``experts``'
        pairs, its buffers given back: its backward computes those alone (hybrid moves the others' backward to the
        GPU). The rows are contiguous per expert, so this is a gather of a few MB."""
        if not isinstance(saved, _SubsetState):
            raise ValueError("keep_experts needs the saved state of a subset (a forward over every pair keeps "
                             "none of its experts apart)")
        if saved.gate_up_out is None:
            raise RuntimeError("moecc: this forward's saved state was already used by a backward")
        rows, offsets = kept_rows(saved.offsets, experts)

        def gathered(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            out = self._saved_buffers.take((rows.numel(), *tensor.shape[1:]), tensor.dtype)
            return torch.index_select(tensor, 0, rows, out=out)

        kept = _SubsetState(gathered(saved.hidden), saved.top_k_weights[rows], offsets,
                            torch.arange(rows.numel(), dtype=torch.int64), gathered(saved.gate_up_out),
                            saved.weights_dtype,
                            None if saved.lora_inner is None else tuple(gathered(t) for t in saved.lora_inner),
                            pair_ids=saved.pair_ids[rows], routing_shape=saved.routing_shape)
        self._give_back(saved)
        return kept

    def _give_back(self, saved: SavedState) -> None:
        """Pools the saved state's large buffers (from ``_saved_buffers``, or made by forward alone)."""
        self._saved_buffers.give(saved.gate_up_out)
        self._saved_buffers.give(saved.hidden)
        for inner in saved.lora_inner or ():
            if inner is not None:
                self._saved_buffers.give(inner)
        saved.gate_up_out = saved.hidden = saved.lora_inner = None

    def backward(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                 gate_up_lora: ExpertLora | None,
                 down_lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
        """See ``moecc.experts.ExpertBackend``; ``grad_out [T, H]`` in host memory."""
        if isinstance(saved, _SubsetState):
            return self._backward_subset(weights, saved, grad_out, gate_up_lora, down_lora)
        return self._backward(weights, saved, grad_out, gate_up_lora, down_lora)

    def backward_pairs(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                       gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, LoraGrads]:
        """:meth:`backward` of a :meth:`forward_pairs` subset with its input gradient as rows: ``(grad_rows [P, H]
        bf16, tokens [P], grad_top_k_weights [T, k], LoraGrads)``, the input gradient being ``grad_rows`` added
        at ``tokens`` into float32 zeros. The rows are bf16 as the kernels compute them (each pair's input gradient
        is rounded to bf16, as a bf16 pipeline rounds each expert's product): half the bytes of float32 for the
        device to read across PCIe, the same values. Where the forward was dense: ``(grad_hidden [T, H], None,
        ...)`` as :meth:`backward`."""
        if not isinstance(saved, _SubsetState):
            grad_hidden, grad_weights, grads = self._backward(weights, saved, grad_out, gate_up_lora, down_lora)
            return grad_hidden, None, grad_weights, grads
        if not rows_pay(saved.pair_ids.numel(), saved.routing_shape[0]):
            grad_hidden, grad_weights, grads = self._backward_subset(weights, saved, grad_out, gate_up_lora,
                                                                     down_lora)
            return grad_hidden, None, grad_weights, grads
        return self._subset_grad_rows(weights, saved, grad_out, gate_up_lora, down_lora)

    def backward_pairs_into(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                            gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None, out: PairGrads) -> None:
        """:meth:`backward_pairs` of a subset whose input gradient leaves as rows, written into ``out`` (the
        caller's host tensors: staging buffers the device reads, say). The kernels write the rows and the LoRA
        gradients' blocks of ``out.lora_experts`` there themselves: nothing is copied or selected afterwards, and
        the other experts' blocks are never written. Every expert of ``saved`` must be among ``lora_experts``."""
        if not isinstance(saved, _SubsetState) or not rows_pay(saved.pair_ids.numel(), saved.routing_shape[0]):
            raise ValueError("backward_pairs_into needs the saved state of a forward_pairs subset whose output left "
                             "as rows; use backward_pairs")
        num_tokens, top_k = saved.routing_shape
        pairs = saved.pair_ids.numel()
        if (tuple(out.tokens.shape) != (pairs,) or out.tokens.dtype != torch.int64
                or tuple(out.grad_weights.shape) != (num_tokens, top_k) or out.grad_weights.dtype != torch.float32
                or not out.grad_weights.is_contiguous()):
            raise ValueError(f"backward_pairs_into: tokens must be int64 [{pairs}] and grad_weights float32 "
                             f"[{num_tokens}, {top_k}], got {out.tokens.dtype} {list(out.tokens.shape)} and "
                             f"{out.grad_weights.dtype} {list(out.grad_weights.shape)}")
        self._subset_grad_rows(weights, saved, grad_out, gate_up_lora, down_lora, into=out)

    def _backward_subset(self, weights: ExpertWeights, saved: _SubsetState, grad_out: torch.Tensor,
                         gate_up_lora: ExpertLora | None,
                         down_lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
        """The subset's problem differentiated, its float32 rows summed into their tokens."""
        grad_rows, tokens, grad_weights, grads = self._subset_grad_rows(weights, saved, grad_out, gate_up_lora,
                                                                        down_lora, rows_dtype=torch.float32)
        num_tokens = saved.routing_shape[0]
        grad_hidden = self._summed_rows(grad_rows, tokens, (num_tokens, grad_out.shape[1]), grad_out.dtype)
        return grad_hidden, grad_weights, grads

    def _subset_grad_rows(self, weights: ExpertWeights, saved: _SubsetState, grad_out: torch.Tensor,
                          gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None,
                          into: PairGrads | None = None, rows_dtype: torch.dtype = torch.bfloat16) -> tuple:
        """(grad rows [P, H] ``rows_dtype`` from the scratch pool, their tokens, grad_top_k_weights [T, k],
        LoraGrads), or ``into``'s tensors holding them (LoraGrads None: ``into``'s blocks)."""
        num_tokens, top_k = saved.routing_shape
        pair_ids = saved.pair_ids
        tokens = torch.div(pair_ids, top_k, rounding_mode="floor", out=None if into is None else into.tokens)
        # The rows go in as they come (bf16 or float32) and their gradients come out float32, for the sum. Gathered
        # into a pooled buffer: fresh pages fault on every call, and index_select beats advanced indexing.
        gathered = self._scratch.take((pair_ids.numel(), grad_out.shape[1]), grad_out.dtype)
        try:
            torch.index_select(grad_out, 0, tokens, out=gathered)
            grad_rows, grad_routing, grads = self._backward(weights, saved, gathered, gate_up_lora, down_lora,
                                                            rows=rows_dtype, into=into)  # [P, H] (scratch), [P, 1]
        finally:
            self._scratch.give(gathered)
        grad_weights = (torch.zeros(num_tokens * top_k, dtype=torch.float32) if into is None
                        else into.grad_weights.zero_().view(-1))
        grad_weights.index_copy_(0, pair_ids, grad_routing.view(-1))
        return grad_rows, tokens, grad_weights.view(num_tokens, top_k), grads

    def _backward(self, weights: ExpertWeights, saved: SavedState, grad_out: torch.Tensor,
                  gate_up_lora: ExpertLora | None, down_lora: ExpertLora | None,
                  rows: torch.dtype | None = None,
                  into: PairGrads | None = None) -> tuple[torch.Tensor, torch.Tensor, LoraGrads]:
        """``rows`` (a dtype): the input gradient is a scratch buffer of that dtype itself, which the caller gives
        back, or ``into.rows`` where ``into`` is given; the LoRA gradients then go to ``into``'s blocks (and come
        back None)."""
        if saved.gate_up_out is None:
            raise RuntimeError("moecc: this forward's saved state was already used by a backward (its buffers are "
                               "reused); run the forward again to differentiate it again")
        matrices = self._matrices(weights)
        shape = (weights.num_experts, weights.hidden_size, weights.intermediate_size)
        routing = saved.top_k_weights.reshape(-1).contiguous()
        # bf16 (and float32) gradients go into the kernel as they are, others through a float32 copy; the input
        # gradient comes out bf16 for a bf16 caller, else into a float32 buffer. Buffers pooled: fresh pages would
        # fault on every call.
        kernel_in = (grad_out.contiguous() if grad_out.dtype in (torch.bfloat16, torch.float32)
                     else self._scratch.take(tuple(grad_out.shape), torch.float32).copy_(grad_out))
        copied_in = kernel_in.dtype != grad_out.dtype
        direct = grad_out.dtype == torch.bfloat16 and rows is None
        if into is not None:
            grad_in = into.rows
            blocks = into.lora_blocks
            for i, (name, lora) in enumerate((("gate_up", gate_up_lora), ("down", down_lora))):
                if lora is not None and (blocks[2 * i] is None or blocks[2 * i + 1] is None):
                    raise ValueError(f"backward_pairs_into: the {name} projection has LoRA but no gradient "
                                     "blocks were given for it; pass its A and B blocks")
            # A's blocks [n, r, in] as the kernels take them; B's [out, r, n] as PEFT's [out, r*n]
            kernel_grads = [None if lora is None else (blocks[2 * i], blocks[2 * i + 1].flatten(1))
                            for i, lora in enumerate((gate_up_lora, down_lora))]
        else:
            grad_in = (self._results.take(tuple(saved.hidden.shape), torch.bfloat16) if direct
                       else self._scratch.take(tuple(saved.hidden.shape), rows or torch.float32))
            lora_grads = [self._lora_grad_buffers(lora) for lora in (gate_up_lora, down_lora)]
            kernel_grads = [_kernel_grads(g, lora) for g, lora in zip(lora_grads, (gate_up_lora, down_lora))]
        try:
            grad_in, grad_routing, _, _ = _ops.expert_ffn_backward(
                self.isa, matrices, shape, saved.top_k_weights.shape[1], saved.hidden, saved.offsets, saved.order,
                routing, _kernel_lora(gate_up_lora), _kernel_lora(down_lora), saved.gate_up_out, kernel_in,
                grad_hidden=grad_in, lora_inner=_inner_for(saved, gate_up_lora, down_lora), tuning=self.tuning,
                lora_grads=kernel_grads, lora_experts=None if into is None else into.lora_experts)
            grad_hidden = grad_in if direct or rows is not None else grad_in.to(grad_out.dtype, copy=True)
        except BaseException:
            if not direct and into is None:
                self._scratch.give(grad_in)
            raise
        finally:
            if copied_in:
                self._scratch.give(kernel_in)
        if not direct and rows is None:
            self._scratch.give(grad_in)
        self._give_back(saved)  # SavedState is single-use: backward drops it after this
        if into is not None:
            return grad_hidden, grad_routing.view(saved.top_k_weights.shape), None
        grads = LoraGrads(*(lora_grads[0] or (None, None)), *(lora_grads[1] or (None, None)))
        return grad_hidden, grad_routing.view(saved.top_k_weights.shape), grads

    def _lora_grad_buffers(self, lora: ExpertLora | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pooled ``(dA [r*E, in], dB [out, r*E])`` float32 for one projection's LoRA gradients: the very tensors
        the caller gets, so it can hand them back through ``release_result`` (the kernel writes A through a view)."""
        if lora is None:
            return None
        return (self._results.take((lora.num_experts * lora.rank, lora.A.shape[-1]), torch.float32),
                self._results.take(tuple(lora.B.shape), torch.float32))
