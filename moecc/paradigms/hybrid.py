"""Hybrid paradigm: in every MoE layer pass the GPU computes the hot experts from copied weights while the CPU
computes the cold ones in place, both at once; the layer's output and every gradient are the two parts' sums.

Composed of three parts: ``DeviceSlots`` (copies, cache, parking, LoRA copies: offload's machinery), ``CpuPart`` (the
CPU backend, staging, worker, the device's waits for it) and a ``SplitPolicy`` (which experts run where;
``MoeccConfig.split_policy``).

Forward, layer i: the router's counts come to the host (one sync, which the CPU side needs anyway). Every routed
expert the policy puts on the GPU runs there (``moecc.experts`` subset, sized from those counts: no second sync);
every other routed expert runs on the CPU (the native kernels, on a worker thread). The policy planned layer i's
copies a layer ahead from a forecast of its routing; layer i's forward queues layer i+1's copies the same way.
Backward, where routing is known from forward: each layer runs its forward's split (each side holds its own saved
state), plus, where the policy finds it pays, some of the forward's CPU experts on the GPU: it recomputes the
forward of all its experts, those and its own, from the hidden states its part saved, and the CPU drops them from
its state (``keep_experts``). Layer i's backward prefetches layer i-1's GPU experts and parked activations.

One set of LoRA factors: on the GPU where they fit (the CPU part reads pinned host mirrors, copied once per pass),
else host parameters read in place by the CPU and copied to the device once per pass; their gradient is the sum of
both sides' (each zero outside its experts).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..config import MoeccConfig
from ..experts import ExpertBackend, LoraGrads, SavedState
from ..experts.grouping import group_by_expert
from ..experts.native import rows_pay
from ..experts.select import cpu_backend, default_device_backend, device_backend
from ..lora import lora_tensors
from .base import (Engine, EngineDescription, ExpertLayer, FiniteFlags, Pending, current_graph_task,
                   node_gradients, routed_counts, saved_state_gone)
from .cpu_part import CpuPart, Landing, forward_rows, hybrid_pool_threads
from .device_slots import Call, DeviceSlots, ParkedState, cache_setting, pin_experts
from .hybrid_metrics import SideMetrics, hybrid_counters, record_forward
from .part_sums import add_grads, add_part, expert_mask, host_sources
from .split_policies import split_policy
from .split_policy import SplitPolicy


class HybridEngine(Engine):
    """Device slots for the GPU part, a CPU part, and the split policy that divides each layer's experts."""

    name = "hybrid"

    def __init__(self, device: torch.device, cpu: ExpertBackend, slots: int = 2, compute: str | None = None,
                 cache_bytes: int = 0, cache_limit: int | None = None, policy: SplitPolicy | None = None) -> None:
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which have one
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        # Two at least: one layer computing, one ahead
        self.slots = DeviceSlots(device, self.layers, self.metrics, lambda: self.forward_passes, max(2, slots),
                                 compute, cache_bytes, cache_limit)
        # Held by each layer call's forward and backward: the slots are shared, so two threads using one model take
        # turns layer by layer (reentrant: a checkpointed layer's recomputation may run on the thread holding it).
        self.lock = threading.RLock()
        self.split: SplitPolicy = split_policy("planned") if policy is None else policy
        self.cpu_part = CpuPart(device, cpu, lambda *sample: self.split.cpu_measured(*sample), self.lock)
        self.all_on_gpu = False  # this pass's: the policy runs every routed expert on the GPU
        self.planned: dict[int, tuple[int, ...]] = {}  # layer -> GPU experts its forward prefetch planned
        self.sides = SideMetrics()
        self._copied_this_pass: dict[int, set[int]] = {}  # layer -> experts its slot got in this forward pass
        self._bytes_mark_staging = (0, 0)

    @classmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> HybridEngine:
        compute = config.offload_compute
        return cls(device, cpu_backend(config.backend, config.isa, prepack=config.prepack_weights),
                   config.offload_slots, default_device_backend(device) if compute == "auto" else compute,
                   *cache_setting(device, config), policy=split_policy(config.split_policy))

    @classmethod
    def pool_threads(cls, device: torch.device) -> int | None:
        """On a GPU machine all CPUs but two: left to the threads that queue the GPU work and drive the copies."""
        return hybrid_pool_threads() if device.type == "cuda" else None

    def add_layer(self, name: str, experts: torch.nn.Module, wrappers: dict) -> HybridLayer:
        """The layer, its experts' weights pinned on CUDA (their copies would stall the host from pageable memory)."""
        if self.device.type == "cuda":
            pin_experts(experts)
        return super().add_layer(name, experts, wrappers)

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        """Expert LoRA on the GPU where it fits (offload's rule: the optimizer steps it there and the GPU part uses
        it in place; the CPU part reads a host mirror), else in host memory with a device copy per pass."""
        self.slots.finish(model, config, device_lora=self.device.type == "cuda")
        self.cpu_part.backend.prepare_layers([layer.weights for layer in self.layers])
        self.split.start(self.device, self.layers)

    def use_split_policy(self, policy: SplitPolicy) -> None:
        """Splits with ``policy`` from the next layer call on (between steps: A/B runs of placements)."""
        policy.start(self.device, self.layers)
        self.split = policy

    def gpu_bytes(self, config: MoeccConfig) -> int:
        return self.slots.gpu_bytes(config)

    def budget_advice(self) -> str:
        return self.slots.budget_advice()

    def describe(self) -> EngineDescription:
        done = self.cpu_part.done
        notes = (() if self.device.type != "cuda" else
                 ("the GPU waits for the CPU parts itself" if done.on_device
                  else f"the host waits for the CPU parts: {done.reason}",))
        return EngineDescription(cpu=self.cpu_part.given, device_math=self.slots.compute, cache=self.slots,
                                 notes=notes)

    def pass_begins(self, tokens: int, training: bool = True) -> None:
        self.slots.pass_begins(tokens, training, self.backward_calls)
        self._copied_this_pass = {}
        self.all_on_gpu = self.split.pass_begins(tokens, training)
        self.sides.gpu_only_steps += self.all_on_gpu and training

    def reset_metrics(self) -> None:
        self.metrics.reset()
        self.slots.reset_metrics()
        self.cpu_part.reset_metrics()
        self.sides = SideMetrics()
        staging = self.cpu_part.staging
        self._bytes_mark_staging = (staging.bytes_to_device, staging.bytes_to_host)

    def counters_since_reset(self) -> dict[str, float]:
        """See ``moecc.paradigms.hybrid_metrics.hybrid_counters``."""
        return hybrid_counters(self)

    def forward_split(self, layer: HybridLayer, counts: list[int]) -> tuple[int, ...]:
        """The experts ``layer`` runs on the GPU in this forward; what the slot still holds from an earlier pass
        (the last backward's copies) costs this pass nothing, what a prefetch copied for it is spent already."""
        present = self.slots.present(layer)
        copied = self._copied_this_pass.get(layer.index, set()) & present
        return self.split.forward(layer, counts, self.slots.cached(layer) | (present - copied), copied)

    def backward_split(self, layer: HybridLayer, counts: list[int], gpu: tuple[int, ...]) -> tuple[int, ...]:
        """The experts ``layer``'s backward will run on the GPU after a forward that ran ``gpu`` there; more than
        those only where the GPU part has pairs (its saved hidden states, which the moved experts' recompute
        reads)."""
        if not any(counts[e] for e in gpu if e < len(counts)):
            return gpu
        return self.split.backward(layer, counts, gpu, self.slots.cached(layer))

    @property
    def prefetch_depth(self) -> int:
        """Layers whose experts are copied ahead of the one computing: every slot but its own. One layer ahead
        leaves the copy engine idle whenever a layer's CPU part outlasts the next layer's copies."""
        return self.slots.capacity - 1

    def prefetch_forward(self, index: int) -> None:
        """Queues layer ``index``'s planned GPU experts (after this layer's own copies)."""
        if not 0 <= index < len(self.layers):
            return
        plan = self.split.prefetch(index, self.slots.cached(self.layers[index]))
        if plan is None:
            return
        self.planned[index] = plan
        if plan:
            self.fetch("forward", self.layers[index], list(plan))

    def fetch(self, phase: str, layer: HybridLayer, experts: list[int], lora: tuple | None = None):
        """``DeviceSlots.fetch``, its copies reported to the policy (how many experts crossed, how long)."""
        if phase == "forward":
            held = self.slots.present(layer)
            self._copied_this_pass.setdefault(layer.index, set()).update(e for e in experts if e not in held)
        slot, copied, timing = self.slots.fetch_measured(layer, experts, lora)
        if copied:
            self.split.copies_measured(phase, copied, timing)
        return slot


class HybridLayer(ExpertLayer):
    """One MoE layer's routed experts, split per pass between the GPU (copied weights) and the CPU (in place)."""

    engine: HybridEngine

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: HybridEngine,
                 index: int) -> None:
        super().__init__(name, experts, wrappers, engine, index)
        self.last_gpu: tuple[int, ...] | None = None  # the GPU experts of the latest forward; backward prefetches
        self.last_cpu = False  # whether the latest forward had a CPU part (its inputs are then staged early)

    def backward_lock(self):
        """The engine's lock: the slots are shared, so one thread's layer call at a time."""
        return self.engine.lock

    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        finite = self.check_inputs(hidden, top_k_index, top_k_weights)
        part = self.engine.cpu_part
        with self.engine.lock:  # the slots are shared: one thread's layer call at a time
            part.join_backward()  # inside a backward (a checkpoint's recomputation): raises the pass's error
            part.join_deferred(self.index, join_part)
            return self.checked(self._submit(hidden, top_k_index, top_k_weights, finite))

    def _submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                finite: FiniteFlags | None) -> HybridPending:
        lora = self.lora()
        factors = lora_tensors(lora)
        self.engine.slots.place_lora(factors)
        counts = routed_counts(top_k_index, self.weights.num_experts, finite)  # refused before any state changes
        call = Call.begin(self, hidden, top_k_weights, factors)
        parts = _Parts()
        out = HybridExpertsFunction.apply(hidden, top_k_weights, top_k_index, self, lora, call, counts, parts,
                                          *factors)
        return HybridPending(out, parts, self.engine, None if call.recompute else self.index)


@dataclass
class _Parts:
    """What one layer call's forward leaves for ``result()`` and backward."""

    gpu: tuple[int, ...] = ()
    cpu: tuple[int, ...] = ()
    gpu_backward: tuple[int, ...] = ()  # ``gpu`` and the CPU experts whose backward moves to the GPU
    landing: Landing | None = None  # the CPU part's
    joined: bool = False  # a landing on the device whose saved state was taken (``join_part``)
    cpu_saved: SavedState | None = None
    gpu_state: SavedState | ParkedState | None = None
    math: ExpertBackend | None = None
    lora: tuple = (None, None)
    cpu_lora: tuple = (None, None)  # the same factors in host memory (mirrors where they live on the GPU)
    weights_host: object = None
    done: bool = False


def join_part(parts: _Parts) -> None:
    """Waits for a forward's CPU part that landed on the device; keeps its saved state (raises its error)."""
    if parts.landing is not None and parts.landing.on_device and not parts.joined:
        parts.cpu_saved = parts.landing.future.result()
        parts.joined = True


class HybridPending:
    """``result()`` waits for the CPU part, brings it to the device and adds it to the GPU part."""

    def __init__(self, output: torch.Tensor, parts: _Parts, engine: HybridEngine, index: int | None) -> None:
        self._output, self._parts, self._engine = output, parts, engine
        self._index = index  # the layer, for the gap to the next one (None: a recomputation)

    def result(self) -> torch.Tensor:
        parts, engine, landing = self._parts, self._engine, self._parts.landing
        part = engine.cpu_part
        if landing is not None and landing.on_device and not parts.done:
            views = part.collect(landing)
            part.metrics.device_waits += part.done.on_device
            with torch.no_grad(), record_function("moecc.hybrid.cpu_to_device"):
                part.staging.read_views_on_device(views, lambda out, out_tokens, out_weights: add_part(
                    self._output, out, out_tokens, out_weights))
            part.defer(self._index, parts)
        elif landing is not None and not parts.done:
            host, tokens, parts.cpu_saved = part.host_result(landing)
            with torch.no_grad(), record_function("moecc.hybrid.cpu_to_device"):
                # Read in place: the GPU part's output, or zeros, plus the CPU part's (dense, or rows per pair)
                sources = {"out": host} if tokens is None else {"out": host, "out_tokens": tokens}
                part.staging.read_on_device(sources, lambda out, out_tokens=None: add_part(self._output, out,
                                                                                          out_tokens))
            part.backend.release_result(host)
        if not parts.done and self._index is not None:
            engine.split.gap("forward", self._index, engine.forward_passes, ends=False)
        parts.done = True
        return self._output


class HybridExpertsFunction(torch.autograd.Function):
    """Autograd node of one hybrid layer: both parts' forward and backward, their results summed."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, counts, parts, *factors):
        with record_function("moecc.hybrid.layer_forward"):  # the span a timeline zooms in on
            return _forward(ctx, hidden, top_k_weights, top_k_index, layer, lora, call, counts, parts)

    @staticmethod
    def backward(ctx, grad_out):
        with record_function("moecc.hybrid.layer_backward"):
            return ctx.layer.checked_backward(grad_out, lambda: _backward(ctx, grad_out))


def _forward(ctx, hidden, top_k_weights, top_k_index, layer: HybridLayer, lora, call: Call, counts, parts: _Parts):
    engine, part = layer.engine, layer.engine.cpu_part
    if call.recompute:  # other layer work inside the backward's gap, which the split's cost does not depend on
        engine.split.gap("backward", layer.index, None, ends=False)
    else:
        engine.split.gap("forward", layer.index, engine.forward_passes, ends=True)
    # The CPU part's inputs start for the host before the split where the layer's last forward had one
    staged = part.stage(layer.index, hidden, top_k_index, top_k_weights, lora) if layer.last_cpu else None
    gpu = engine.forward_split(layer, counts)
    on_gpu = set(gpu)
    cpu = tuple(e for e, n in enumerate(counts) if n > 0 and e not in on_gpu)
    parts.gpu, parts.cpu, parts.lora, parts.weights_host = gpu, cpu, lora, layer.weights
    if cpu:  # first: the CPU starts as soon as the activations reach the host
        staged, parts.cpu_lora, ready = staged or part.stage(layer.index, hidden, top_k_index, top_k_weights, lora)
        may_land = not call.recompute and part.may_land_on_device(layer.weights, (), engine.forward_passes, False)
        rows = forward_rows(may_land, layer.index == len(engine.layers) - 1, sum(counts[e] for e in cpu),
                            top_k_index.numel(), hidden)
        parts.landing = part.forward(layer.index, parts.weights_host, staged, parts.cpu_lora, ready, cpu, counts,
                                     rows)
    # Planned once the CPU part runs: the forward's CPU part does not depend on it
    parts.gpu_backward = engine.backward_split(layer, counts, gpu) if cpu and call.keep else gpu
    if parts.gpu_backward != gpu:
        ctx.top_k_index = top_k_index  # the GPU recomputes the moved experts' forward from it in backward
    slot = engine.fetch("forward", layer, list(gpu)) if gpu else None
    if not call.recompute:
        record_forward(engine, layer, counts, gpu, cpu, parts.gpu_backward)
        for ahead in range(1, engine.prefetch_depth + 1):
            engine.prefetch_forward(layer.index + ahead)
    if gpu:
        out, parts.gpu_state, parts.math = _gpu_forward(engine, layer, slot, hidden, top_k_index, top_k_weights,
                                                        lora, gpu, call, sum(counts[e] for e in gpu))
    else:
        out = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    ctx.layer, ctx.parts, ctx.call, ctx.counts = layer, parts, call, counts
    ctx.dtypes = (hidden.dtype, top_k_weights.dtype)
    ctx.weights_shape = top_k_weights.shape
    return out


def _backward(ctx, grad_out):
    layer, parts, engine = ctx.layer, ctx.parts, ctx.layer.engine
    part = engine.cpu_part
    # The layer after's CPU part: its error stops the pass before this layer changes (a reentrant checkpoint
    # segment's own pass files an outer part's error for the outer pass, which raises it at its next join)
    part.join_backward()
    if part.first_backward_pass is None:
        part.first_backward_pass = engine.forward_passes
    join_part(parts)
    if not parts.done or (parts.cpu and parts.cpu_saved is None) or (parts.gpu and parts.gpu_state is None):
        raise saved_state_gone("hybrid")
    forward_pass = None if ctx.call.recompute else ctx.call.key[0]  # a recomputed call's is not known
    engine.split.gap("backward", layer.index, forward_pass, ends=True)
    landing = None
    moved = tuple(e for e in parts.gpu_backward if e not in set(parts.gpu))
    cpu_experts = tuple(e for e in parts.cpu if e not in set(moved))
    saved, parts.cpu_saved = parts.cpu_saved, None
    if saved is not None and not cpu_experts:  # every CPU expert's backward moved to the GPU
        part.backend.release(saved)
    elif cpu_experts:
        counts = [ctx.counts[e] for e in cpu_experts]
        staged = part.staging.to_host({"grad_out": grad_out.contiguous()})
        target = _backward_target(engine, layer, parts, grad_out, ctx.weights_shape, counts, cpu_experts)
        landing = part.backward(layer.index, parts.weights_host, saved, staged, parts.cpu_lora, counts,
                                cpu_experts if moved else None, target)
    slot = engine.fetch("backward", layer, list(parts.gpu_backward), parts.lora) if parts.gpu_backward else None
    if isinstance(parts.gpu_state, ParkedState):
        engine.slots.parking.restore(parts.gpu_state)  # queued now unless the layer after prefetched it
    _prefetch_backward(engine, layer, ctx.call)  # queued before this layer's compute
    grads = _gpu_backward(engine, layer, parts, slot, grad_out, moved, ctx) if parts.gpu else None
    if landing is not None and landing.on_device:
        views = part.collect(landing)
        part.metrics.backward_device_waits += part.done.on_device
        with torch.no_grad():
            grads = add_grads(part.staging, grads, views, landing.bank, parts.lora, grad_out, ctx.weights_shape)
    elif landing is not None:
        cpu_hidden, cpu_tokens, cpu_weights, cpu_lora = part.host_result(landing)
        sources = host_sources(cpu_hidden, cpu_tokens, cpu_weights, cpu_lora, cpu_experts, parts.lora)
        grads = add_grads(part.staging, grads, sources, "", parts.lora, grad_out, ctx.weights_shape)
        # Read: add_grads took copies of what it sums (index_select of the LoRA gradients' CPU expert blocks)
        for result in (cpu_hidden, *vars(cpu_lora).values()):
            if result is not None:
                part.backend.release_result(result)
    if grads is None:  # no routed pair on either side (no tokens): every gradient is zero
        grads = torch.zeros_like(grad_out), grad_out.new_zeros(ctx.weights_shape), LoraGrads.zeros(*parts.lora)
    grad_hidden, grad_weights, lora_grads = grads
    engine.split.gap("backward", layer.index, forward_pass, ends=False)
    return node_gradients(ctx, grad_hidden.to(ctx.dtypes[0]), grad_weights.to(ctx.dtypes[1]), parts.lora,
                          lora_grads)


def _backward_target(engine: HybridEngine, layer: HybridLayer, parts: _Parts, grad_out: torch.Tensor,
                     weights_shape: torch.Size, counts: list[int], cpu_experts: tuple[int, ...]) -> tuple | None:
    """Where a backward's CPU part lands on the device (``CpuPart.backward_target``), or None where the caller
    waits: outside the autograd engine's backward (a node's backward called directly: nothing would join it), where
    the part may not land there, and where its input gradient leaves dense (``rows_pay``)."""
    part, pairs = engine.cpu_part, sum(counts)
    if (current_graph_task() == -1
            or not part.may_land_on_device(layer.weights, lora_tensors(parts.lora), engine.forward_passes, True)
            or pairs >= weights_shape.numel() or not rows_pay(pairs, grad_out.shape[0])):
        return None
    return part.backward_target(layer.index, layer.weights.num_experts, parts.lora, grad_out, weights_shape,
                                cpu_experts, pairs)


def _grouping(engine: HybridEngine, top_k_index: torch.Tensor, num_experts: int, experts: tuple[int, ...],
              pairs: int):
    """The grouping of ``experts``' routed pairs (``pairs`` of them, counted on the host): every pair's, with no
    mask or subset (their ~15 ops), where those experts hold every routed pair."""
    if pairs == top_k_index.numel():
        return group_by_expert(top_k_index, num_experts)
    mask = expert_mask(experts, num_experts, engine.cpu_part.staging)
    return group_by_expert(top_k_index, num_experts, mask, num_pairs=pairs)


def _gpu_forward(engine: HybridEngine, layer: HybridLayer, slot, hidden, top_k_index, top_k_weights, lora, gpu,
                 call: Call, pairs: int):
    # The subset's size from the host's counts: sized by a sync, it kept the host waiting for this layer's copies
    slots = engine.slots
    grouping = _grouping(engine, top_k_index, layer.weights.num_experts, gpu, pairs)
    slots.use(slot)
    begun = slots.compute_begins()
    device_lora = slots.device_lora(slot, lora)
    math = device_backend(slots.compute)
    with record_function("moecc.hybrid.gpu_forward"):
        out, saved = math.forward(slots.device_weights(layer, slot), hidden, top_k_index, top_k_weights,
                                  *device_lora, grouping=grouping)
    slots.done_with(slot)
    slots.compute_ends(begun, backward=False)
    return out, slots.keep_for_backward(call, saved), math


def _gpu_backward(engine: HybridEngine, layer: HybridLayer, parts: _Parts, slot, grad_out, moved: tuple, ctx):
    """The GPU part's gradients: its own forward's experts from their saved state; with ``moved`` experts (whose
    forward ran on the CPU) as well, every one of ``parts.gpu_backward`` from one forward recomputed on the hidden
    states that state holds, and one backward: two parts' calls and their sum queued twice the host's ops, on a
    host thread that paces the backward at small batches."""
    slots = engine.slots
    state, parts.gpu_state = parts.gpu_state, None
    slots.use(slot)
    saved = slots.unpark(state)
    begun = slots.compute_begins()
    device_lora = slots.device_lora(slot, parts.lora)
    weights = slots.device_weights(layer, slot)
    with record_function("moecc.hybrid.gpu_backward"):
        if moved:
            experts = parts.gpu_backward
            grouping = _grouping(engine, ctx.top_k_index, layer.weights.num_experts, experts,
                                 sum(ctx.counts[e] for e in experts))
            with torch.no_grad():
                _, saved = parts.math.forward(weights, saved.hidden, ctx.top_k_index, saved.top_k_weights,
                                              *device_lora, grouping=grouping)
        result = parts.math.backward(weights, saved, grad_out, *device_lora)
    slots.done_with(slot)
    slots.compute_ends(begun, backward=True)
    return result


def _prefetch_backward(engine: HybridEngine, layer: HybridLayer, call: Call) -> None:
    """Queues the GPU experts (known exactly from their forward) and parked activations of the layers before, as
    many as the slots hold beside this one's."""
    for previous in engine.layers[max(0, layer.index - engine.prefetch_depth):layer.index][::-1]:
        if previous.last_gpu:
            engine.fetch("backward", previous, list(previous.last_gpu))
        engine.slots.parking.prefetch((call.key[0], previous.index))


HybridEngine.layer_class = HybridLayer
