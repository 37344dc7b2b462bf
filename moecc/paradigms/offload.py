"""Offload paradigm: routed experts computed on the device after their weights are copied there.

Expert weights stay in host memory (pinned on CUDA), one copy. Per MoE layer the engine copies the experts the
batch routes to (all of them when most are hit) into a device slot on a dedicated copy stream. While a layer
computes, the next layer's experts are already being copied when the batch is large enough to touch most
experts; in backward, where every layer's routed experts are known from forward, the previous layer's experts
are copied while the current one computes. Slots are bounded (by the GPU memory budget) and reused.

The expert math on the device is chosen per engine (``DeviceSlots.compute``, from
``MoeccConfig.offload_compute``): ``"grouped"`` (``moecc.experts.grouped``: one grouped matrix product per
projection, LoRA factorised; agrees with HF + PEFT to the dtype's rounding; the default on CUDA) or ``"reference"``
(``moecc.experts.reference``: one expert at a time with PEFT's folded ``W + ΔW``, bit-exact with HF + PEFT; the default
elsewhere, so CPU runs stay exact). The expert LoRA factors (``MoeccConfig.offload_lora``) live on the device
when they fit a quarter of the budget with their gradients and optimizer state, and are used in place there;
otherwise they stay host parameters (pinned on CUDA), copied to the device once per forward pass. With a cache
budget (``MoeccConfig.offload_cache_gb``) the most frequently routed experts also stay on the device
(``moecc.paradigms.expert_cache``) and fill slots without crossing PCIe.

What a layer keeps for its backward (``SavedState``: hidden ``[T, H]``, pre-activations ``[T*k, 2I]``, routing
weights and grouping, ~29 KB per token for Qwen3-30B-A3B) is parked in host memory between its forward and its
backward (``DeviceSlots.park_activations``, default on): copied device to host on a side stream once the
layer's forward is computed, and brought back in backward one layer ahead, next to the prefetched expert
weights. A forward run inside backward (a checkpointed layer recomputed) keeps its state on the device instead,
and prefetches nothing forwards.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.profiler import record_function

from ..config import MoeccConfig
from ..experts.select import device_backend
from ..lora import lora_tensors
from .base import Engine, EngineDescription, ExpertLayer, Pending, Ready, node_gradients, routed_counts, saved_state_gone
from .device_slots import Call, DeviceSlots, ParkedState, cache_setting, pin_experts


class OffloadEngine(Engine):
    """Device slots (``DeviceSlots``: copies, cache, parking, LoRA copies) and the lock their layers take turns
    under."""

    name = "offload"

    def __init__(self, device: torch.device, slots: int = 2, compute: str | None = None,
                 cache_bytes: int = 0, cache_limit: int | None = None) -> None:
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which have one
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self.slots = DeviceSlots(device, self.layers, self.metrics, lambda: self.forward_passes, slots, compute,
                                 cache_bytes, cache_limit)
        # Held by each layer call's forward and backward: slots are shared, so two threads using one model take
        # turns layer by layer (reentrant: a checkpointed layer's recomputation may run on the thread holding it).
        self.lock = threading.RLock()

    @classmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> OffloadEngine:
        return cls(device, config.offload_slots, config.offload_compute, *cache_setting(device, config))

    def add_layer(self, name: str, experts: torch.nn.Module, wrappers: dict) -> OffloadLayer:
        """The layer, its experts' weights pinned on CUDA: copied to the device every layer call, from pageable
        memory each copy would stall the host while CUDA stages it."""
        if self.device.type == "cuda":
            pin_experts(experts)
        return super().add_layer(name, experts, wrappers)

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        self.slots.finish(model, config)

    def pass_begins(self, tokens: int, training: bool = True) -> None:
        self.slots.pass_begins(tokens, training, self.backward_calls)

    def gpu_bytes(self, config: MoeccConfig) -> int:
        return self.slots.gpu_bytes(config)

    def budget_advice(self) -> str:
        return self.slots.budget_advice()

    def describe(self) -> EngineDescription:
        return EngineDescription(device_math=self.slots.compute, cache=self.slots)

    def reset_metrics(self) -> None:
        self.metrics.reset()
        self.slots.reset_metrics()

    def counters_since_reset(self) -> dict[str, float]:
        """``DeviceSlots.counters_since_reset``: the co-compute engine's keys (``cpu_experts_s`` 0) and the copies'."""
        return self.slots.counters_since_reset()


class OffloadLayer(ExpertLayer):
    """One MoE layer's routed experts, computed on the device from copied weights."""

    engine: OffloadEngine

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: OffloadEngine,
                 index: int) -> None:
        super().__init__(name, experts, wrappers, engine, index)
        self.last_experts: list[int] | None = None  # routed in the latest forward; backward prefetches them

    def backward_lock(self) -> contextlib.AbstractContextManager:
        """The engine's lock: the slots are shared, so one thread's layer call at a time."""
        return self.engine.lock

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        """Queues the layer's copies and compute on the device; ``result()`` hands the output over."""
        finite = self.check_inputs(hidden, top_k_index, top_k_weights)
        # A host sync: which experts to copy, and their token counts; bad ids and non-finite inputs are refused
        # before any slot changes
        counts = routed_counts(top_k_index, self.weights.num_experts, finite)
        lora = self.lora()
        factors = lora_tensors(lora)
        engine = self.engine
        with engine.lock:
            engine.slots.place_lora(factors)
            call = Call.begin(self, hidden, top_k_weights, factors)
            out = OffloadExpertsFunction.apply(hidden, top_k_weights, top_k_index, self, lora, call, counts, *factors)
        return self.checked(Ready(out))


class OffloadExpertsFunction(torch.autograd.Function):
    """Autograd node of one offloaded layer; backward copies the layer's experts again (prefetched), and its
    saved state back from host memory (prefetched with them)."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, token_counts, *lora_tensors):
        slots, num_experts = layer.engine.slots, layer.weights.num_experts
        # Every expert when the slot holds them all (prefetched whole, as for every layer after the first when
        # batches are large), else the routed ones (``token_counts``, read on the host before the compute is
        # queued, so nothing waits for it).
        experts = (list(range(num_experts)) if slots.holds_all(layer)
                   else [e for e, count in enumerate(token_counts) if count])
        layer.last_experts = experts
        slot = slots.fetch(layer, experts)
        if not call.recompute:  # inside backward the engine prefetches the layers before, not after
            many = len(experts) * 2 >= num_experts
            slots.prefetch(layer.index + 1, None if many else [])  # next layer's routing is unknown: all or none
        slots.use(slot)
        begun = slots.compute_begins()
        device_lora = slots.device_lora(slot, lora)
        math = device_backend(slots.compute)  # backward uses the same, whatever compute is by then
        with record_function("moecc.offload.forward"):
            out, saved = math.forward(slots.device_weights(layer, slot), hidden, top_k_index, top_k_weights,
                                      *device_lora)
        slots.done_with(slot)
        slots.compute_ends(begun, backward=False)
        if not call.recompute:
            layer.engine.metrics.add_expert_counts(token_counts)
            if slots.cache is not None:
                slots.cache.observe(layer.index, token_counts)
        ctx.state = slots.keep_for_backward(call, saved)  # nothing else holds the saved tensors
        ctx.layer, ctx.lora, ctx.experts, ctx.math, ctx.key = layer, lora, experts, math, call.key
        ctx.dtypes = (hidden.dtype, top_k_weights.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.layer.checked_backward(grad_out, lambda: OffloadExpertsFunction._backward(ctx, grad_out))

    @staticmethod
    def _backward(ctx, grad_out):
        layer, state = ctx.layer, ctx.state
        slots = layer.engine.slots
        if state is None:
            raise saved_state_gone("offloaded")
        ctx.state = None
        slot = slots.fetch(layer, ctx.experts, ctx.lora)  # the factors forward used, whatever is active now
        if isinstance(state, ParkedState):
            slots.parking.restore(state)  # queued now unless the layer after prefetched it
        previous = layer.engine.layers[layer.index - 1] if layer.index > 0 else None
        if previous is not None and previous.last_experts is not None:
            slots.prefetch(layer.index - 1, previous.last_experts)
        if previous is not None:
            slots.parking.prefetch((ctx.key[0], previous.index))
        slots.use(slot)
        saved = slots.unpark(state)
        begun = slots.compute_begins()
        device_lora = slots.device_lora(slot, ctx.lora)
        with record_function("moecc.offload.backward"):
            grad_hidden, grad_weights, grads = ctx.math.backward(slots.device_weights(layer, slot), saved, grad_out,
                                                                 *device_lora)
        slots.done_with(slot)
        slots.compute_ends(begun, backward=True)
        return node_gradients(ctx, grad_hidden.to(ctx.dtypes[0]), grad_weights.to(ctx.dtypes[1]), ctx.lora, grads)


OffloadEngine.layer_class = OffloadLayer
