"""Offload paradigm: routed experts computed on the device after their weights are copied there.

Expert weights stay in host memory (pinned on CUDA), one copy. Per MoE layer the engine copies the experts the
batch routes to (all of them when most are hit) into a device slot on a dedicated copy stream. While a layer
computes, the next layer's experts are already being copied when the batch is large enough to touch most
experts; in backward, where every layer's routed experts are known from forward, the previous layer's experts
are copied while the current one computes. Slots are bounded (by the GPU memory budget) and reused.

The expert math on the device is chosen per engine (``OffloadEngine.compute``, default from
``MOECC_OFFLOAD_COMPUTE``): ``"grouped"`` (``moecc.grouped_experts``: one grouped matrix product per projection,
LoRA factorised; agrees with HF + PEFT to the dtype's rounding; the default on CUDA) or ``"reference"``
(``moecc.reference``: one expert at a time with PEFT's folded ``W + ΔW``, bit-exact with HF + PEFT; the default
elsewhere, so CPU runs stay exact). LoRA factors stay host-resident parameters and travel with the activations.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict

import torch
from torch.profiler import record_function

from .. import grouped_experts, reference
from ..errors import MoeccError
from ..lora import factor_gradients, layer_lora, lora_tensors, merge_revision
from ..reference import ExpertLora, ExpertWeights
from ..store import expert_weights
from .cocompute import StepMetrics

EXPERT_MATH = {"grouped": grouped_experts, "reference": reference}  # modules with experts_forward / _backward
COMPUTE_ENV = "MOECC_OFFLOAD_COMPUTE"


def check_compute(value: str, source: str) -> str:
    """``value`` if it names an entry of ``EXPERT_MATH``; otherwise an error saying where it came from."""
    if value not in EXPERT_MATH:
        raise MoeccError(
            f"{source}={value!r} is not an offload expert computation; use 'grouped' (grouped matrix products, "
            "LoRA factorised, agrees with HF + PEFT to the dtype's rounding) or 'reference' (bit-exact with "
            "HF + PEFT, one expert at a time)"
        )
    return value


def default_compute(device: torch.device) -> str:
    """``MOECC_OFFLOAD_COMPUTE`` when set; otherwise ``"grouped"`` on CUDA and ``"reference"`` elsewhere."""
    value = os.environ.get(COMPUTE_ENV, "").strip().lower()
    if value:
        return check_compute(value, COMPUTE_ENV)
    return "grouped" if device.type == "cuda" else "reference"


class _Slot:
    """Device copies of one layer's experts; ``present`` says which experts hold valid data."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.layer: int | None = None
        self.revision: tuple = ()  # PEFT merge state the copies were made under
        self.present: set[int] = set()
        self.ready: torch.cuda.Event | None = None  # copies into the slot done
        self.released: torch.cuda.Event | None = None  # compute reading the slot done


class OffloadEngine:
    """Copy stream, device slots (LRU over layers), metrics, and the layer list for prefetching."""

    def __init__(self, device: torch.device, slots: int = 2, compute: str | None = None) -> None:
        self.device = device
        self.capacity = max(1, slots)
        self.compute = default_compute(device) if compute is None else compute
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.slots: OrderedDict[int, _Slot] = OrderedDict()
        self.layers: list[OffloadLayer] = []
        self.metrics = StepMetrics()
        self.h2d_bytes = 0
        self.copy_s = 0.0  # measured directly where copies are synchronous (no CUDA)
        self._mark = 0
        # CUDA event pairs: around each batch of copies on the copy stream, and around each wait of the compute
        # stream for a slot; read (and synchronised) only when metrics are asked for.
        self._copy_events: list[tuple] = []
        self._wait_events: list[tuple] = []
        self._compute_events: list[tuple] = []  # around each expert computation on the compute stream

    @property
    def compute(self) -> str:
        """Expert math on the device: ``"grouped"`` or ``"reference"`` (see the module docstring)."""
        return self._compute

    @compute.setter
    def compute(self, value: str) -> None:
        self._compute = check_compute(value, "OffloadEngine.compute")

    def reset_metrics(self) -> None:
        self.metrics.reset()
        self._mark = self.h2d_bytes
        self.copy_s = 0.0
        self._copy_events, self._wait_events, self._compute_events = [], [], []

    def compute_begins(self) -> tuple:
        """Marks the start of expert math on the compute stream; pass the result to :meth:`compute_ends`."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        return time.perf_counter(), event

    def compute_ends(self, begun: tuple, backward: bool) -> None:
        """Adds the expert math's time: GPU time between events on CUDA, wall time elsewhere."""
        start, event = begun
        if event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._compute_events.append((event, end))
        elif backward:
            self.metrics.cpu_backward_s += time.perf_counter() - start
        else:
            self.metrics.cpu_forward_s += time.perf_counter() - start

    @staticmethod
    def _elapsed_s(pairs: list[tuple]) -> float:
        total = 0.0
        for start, end in pairs:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def metrics_since_reset(self) -> dict[str, float]:
        """Same keys as the co-compute engine's; ``cpu_experts_s`` is 0, ``copy_s`` the time copies took,
        ``gpu_wait_s`` the time the compute stream stalled waiting for them and ``expert_compute_s`` the
        device time of the expert math (all from CUDA events on a GPU)."""
        m = self.metrics
        return {"cpu_experts_s": 0.0, "h2d_gb": (self.h2d_bytes - self._mark) / 1e9, "d2h_gb": 0.0,
                "gpu_wait_s": m.wait_s + self._elapsed_s(self._wait_events), "tokens": float(m.tokens),
                "routing_skew": m.routing_skew, "copy_s": self.copy_s + self._elapsed_s(self._copy_events),
                "expert_compute_s": m.cpu_forward_s + m.cpu_backward_s + self._elapsed_s(self._compute_events)}

    def _slot_for(self, layer: OffloadLayer) -> _Slot:
        if layer.index in self.slots:
            self.slots.move_to_end(layer.index)
            return self.slots[layer.index]
        host = layer.host_weights
        if len(self.slots) < self.capacity:
            slot = _Slot(torch.empty(host.gate_up.shape, dtype=host.gate_up.dtype, device=self.device),
                         torch.empty(host.down.shape, dtype=host.down.dtype, device=self.device))
        else:
            _, slot = self.slots.popitem(last=False)
            if slot.gate_up.shape != host.gate_up.shape or slot.gate_up.dtype != host.gate_up.dtype:
                slot = _Slot(torch.empty_like(host.gate_up, device=self.device),
                             torch.empty_like(host.down, device=self.device))
            elif slot.released is not None and self.copy_stream is not None:
                self.copy_stream.wait_event(slot.released)  # the last reader of this slot must finish first
        slot.layer, slot.present, slot.ready = layer.index, set(), None
        self.slots[layer.index] = slot
        return slot

    def fetch(self, layer: OffloadLayer, experts: list[int]) -> _Slot:
        """Starts copying the experts the slot lacks; returns the slot (wait on ``slot.ready`` before use)."""
        slot = self._slot_for(layer)
        if slot.revision != layer.revision():
            slot.present, slot.revision = set(), layer.revision()  # merged into: device copies are stale
        missing = [e for e in experts if e not in slot.present]
        if not missing:
            return slot
        host = layer.host_weights
        with record_function("moecc.offload.copy_experts"):
            if self.copy_stream is None:
                start = time.perf_counter()
                for e in missing:
                    slot.gate_up[e].copy_(host.gate_up[e])
                    slot.down[e].copy_(host.down[e])
                self.copy_s += time.perf_counter() - start
            else:
                with torch.cuda.stream(self.copy_stream):
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(self.copy_stream)
                    for e in missing:
                        slot.gate_up[e].copy_(host.gate_up[e], non_blocking=True)
                        slot.down[e].copy_(host.down[e], non_blocking=True)
                    slot.ready = torch.cuda.Event(enable_timing=True)
                    slot.ready.record(self.copy_stream)
                    self._copy_events.append((begin, slot.ready))
        self.h2d_bytes += len(missing) * (host.gate_up[0].nbytes + host.down[0].nbytes)
        slot.present.update(missing)
        return slot

    def use(self, slot: _Slot) -> None:
        """Makes the current stream wait for the slot's copies; the stall is timed with events around it."""
        if slot.ready is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(slot.ready)
            after.record(stream)
            self._wait_events.append((before, after))

    def done_with(self, slot: _Slot) -> None:
        if self.device.type == "cuda":
            slot.released = torch.cuda.current_stream(self.device).record_event()

    def prefetch(self, index: int, experts: list[int] | None) -> None:
        """Starts copying layer ``index``'s experts (all when ``experts`` is None), if that layer exists."""
        if 0 <= index < len(self.layers) and self.capacity > 1:
            layer = self.layers[index]
            self.fetch(layer, experts if experts is not None else list(range(layer.host_weights.num_experts)))


class _Done:
    """``submit`` computes at once on the device (asynchronously there); ``result`` just hands it over."""

    def __init__(self, output: torch.Tensor) -> None:
        self._output = output

    def result(self) -> torch.Tensor:
        return self._output


class OffloadLayer:
    """One MoE layer's routed experts, computed on the device from copied weights."""

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: OffloadEngine,
                 index: int) -> None:
        self.name, self.experts, self.wrappers, self.engine, self.index = name, experts, wrappers, engine, index
        self.last_experts: list[int] | None = None  # routed in the latest forward; backward prefetches them

    def revision(self) -> tuple:
        """Changes when PEFT merges adapters into (or out of) the host weights."""
        return merge_revision(self.wrappers)

    @property
    def host_weights(self) -> ExpertWeights:
        return expert_weights(self.experts)

    def lora(self) -> tuple[ExpertLora | None, ExpertLora | None]:
        return layer_lora(self.wrappers)

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> _Done:
        lora = self.lora()
        if self.index == 0 and torch._C._current_graph_task_id() == -1:
            self.engine.metrics.tokens += hidden.shape[0]
        out = OffloadExpertsFunction.apply(hidden, top_k_weights, top_k_index, self, lora, *lora_tensors(lora))
        return _Done(out)

    def device_weights(self, slot: _Slot) -> ExpertWeights:
        host = self.host_weights
        to = self.engine.device
        return ExpertWeights(
            slot.gate_up, slot.down,
            None if host.gate_up_bias is None else host.gate_up_bias.to(to, non_blocking=True),  # frozen
            None if host.down_bias is None else host.down_bias.to(to, non_blocking=True),
            host.transposed, host.interleaved, host.swiglu_alpha, host.swiglu_limit,
        )


def _on_device(lora: ExpertLora | None, device: torch.device) -> ExpertLora | None:
    """Device copies of the factors, queued without a blocking copy's stream sync. Safe while the optimizer
    writes the host factors: CUDA stages pageable memory before returning, and backward's gradient copy back to
    the host waits for this layer's stream before any optimizer step can run."""
    if lora is None:
        return None
    a, b = (t.detach().to(device, non_blocking=True) for t in (lora.A, lora.B))
    return ExpertLora(a, b, lora.scaling, lora.num_experts)


class OffloadExpertsFunction(torch.autograd.Function):
    """Autograd node of one offloaded layer; backward copies the layer's experts again (prefetched)."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, *lora_tensors):
        engine, num_experts = layer.engine, layer.host_weights.num_experts
        # The one host sync per layer: which experts to copy, and their token counts for the metrics (read here,
        # before the compute is queued, so nothing waits for it).
        routed, counts = torch.unique(top_k_index, return_counts=True)
        experts, counts = torch.stack([routed.long(), counts]).tolist()
        layer.last_experts = experts
        slot = engine.fetch(layer, experts)
        many = len(experts) * 2 >= num_experts
        engine.prefetch(layer.index + 1, None if many else [])  # next layer's routing is unknown: all or none
        engine.use(slot)
        begun = engine.compute_begins()
        device_lora = tuple(_on_device(part, engine.device) for part in lora)
        math = EXPERT_MATH[engine.compute]  # backward uses the same, whatever compute is by then
        with record_function("moecc.offload.forward"):
            out, saved = math.experts_forward(layer.device_weights(slot), hidden, top_k_index, top_k_weights,
                                              *device_lora)
        engine.done_with(slot)
        engine.compute_ends(begun, backward=False)
        token_counts = [0] * num_experts
        for expert, count in zip(experts, counts):
            token_counts[expert] = count
        engine.metrics.expert_token_counts.append(token_counts)
        ctx.layer, ctx.saved, ctx.lora, ctx.experts, ctx.math = layer, saved, lora, experts, math
        ctx.dtypes = (hidden.dtype, top_k_weights.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layer, engine = ctx.layer, ctx.layer.engine
        if ctx.saved is None:
            raise RuntimeError("moecc: offloaded experts' saved activations were released after the first backward")
        slot = engine.fetch(layer, ctx.experts)
        previous = engine.layers[layer.index - 1] if layer.index > 0 else None
        if previous is not None and getattr(previous, "last_experts", None) is not None:
            engine.prefetch(layer.index - 1, previous.last_experts)
        engine.use(slot)
        begun = engine.compute_begins()
        device_lora = tuple(_on_device(part, engine.device) for part in ctx.lora)
        with record_function("moecc.offload.backward"):
            grad_hidden, grad_weights, grads = ctx.math.experts_backward(layer.device_weights(slot), ctx.saved,
                                                                         grad_out, *device_lora)
        engine.done_with(slot)
        engine.compute_ends(begun, backward=True)
        ctx.saved = None
        return (grad_hidden.to(ctx.dtypes[0]), grad_weights.to(ctx.dtypes[1]), None, None, None,
                *factor_gradients(ctx.lora, grads))
