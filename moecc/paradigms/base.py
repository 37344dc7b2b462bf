"""What every paradigm implements, and the pieces they share.

A paradigm is an :class:`Engine` (state shared by a model's MoE layers: streams, buffers, the expert backend,
metrics) and its :class:`ExpertLayer` class (one MoE layer's routed experts). ``moecc.prepare`` builds an engine
from ``MoeccConfig`` (:meth:`Engine.from_config`), adds one layer per sparse block (:meth:`Engine.add_layer`),
lets the engine finish once every adapter exists (:meth:`Engine.finish`) and checks the GPU budget against
:meth:`Engine.gpu_bytes`. The family adapters (``moecc.models``) call ``layer.submit(...)`` where the original
model calls its experts, queue device work that does not need the routed output, then take ``.result()``.
Registering a paradigm: a module with an engine and a layer class, and one entry in ``moecc.paradigms.PARADIGMS``.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import torch

from ..config import MoeccConfig
from ..errors import MoeccError
from ..experts import ExpertLora, ExpertWeights, LoraGrads
from ..lora import factor_gradients, layer_lora, merge_revision
from ..store import expert_weights
from .event_spans import RoutingSkew
from .torch_internals import current_graph_task_id

# Metric names without a CUDA device (Engine.metrics_since_reset): no link to cross, no GPU to wait.
HOST_NAMES = {"h2d_gb": "host_copy_in_gb", "d2h_gb": "host_copy_out_gb", "gpu_wait_s": "expert_wait_s"}
# The GPU budget estimate's margin for the activations of a small batch and allocator slack.
BUDGET_SLACK = 1.1


@dataclass
class StepMetrics:
    """Counters accumulated since the last ``reset``; read by benchmarks and the Trainer callback."""

    cpu_forward_s: float = 0.0
    cpu_backward_s: float = 0.0
    wait_s: float = 0.0  # time the caller blocked on CPU expert results in forward
    tokens: int = 0  # tokens entering the first MoE layer (forward passes, not checkpoint recomputation)
    tokens_routed: int = 0  # (token, expert) pairs over all layers
    skew: RoutingSkew = field(default_factory=RoutingSkew)  # fed one [E] list (or device tensor) per layer call

    def reset(self) -> None:
        self.cpu_forward_s = self.cpu_backward_s = self.wait_s = 0.0
        self.tokens = self.tokens_routed = 0
        self.skew = RoutingSkew()

    def add_expert_counts(self, counts) -> None:
        """One layer call's ``[E]`` pairs per expert (a list, or a tensor read later)."""
        self.skew.add(counts)

    @property
    def routing_skew(self) -> float:
        """Mean over layer calls of (most tokens on one expert) / (mean tokens per expert); 1 is perfectly even."""
        return self.skew.mean()


@dataclass(frozen=True)
class EngineDescription:
    """What an engine runs where, for the line ``moecc.prepare`` logs (``moecc.engine_summary``)."""

    cpu: object | None = None  # the CPU expert backend (co-compute, hybrid)
    device_math: str | None = None  # the device's expert math (offload, hybrid): ``offload_compute``'s names
    cache: object | None = None  # the ``DeviceSlots`` whose expert cache the line describes
    notes: tuple[str, ...] = ()  # further clauses, in words


class Worker:
    """An engine's one background thread for CPU expert work (layers are sequential; the kernels parallelise
    inside a call). In a forked child the parent's thread does not exist, so a job would wait for ever: the first
    submit there starts a new thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pid = os.getpid()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn, *args) -> Future:
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        return self._executor.submit(_without_autograd, fn, *args)


def _without_autograd(fn, *args):
    """A worker job with autograd off (its thread's own mode): the CPU math records no graph, and a view of a
    LoRA factor that requires grad taken here while the caller's thread passes the same factor to an autograd
    Function deadlocked the two (torch's gradient accumulator takes the factor's lock, then the GIL)."""
    with torch.no_grad():
        return fn(*args)


class Pending(Protocol):
    """What ``ExpertLayer.submit`` returns: ``result()`` is the routed-expert output ``[T, H]`` on the device."""

    def result(self) -> torch.Tensor: ...


class Ready:
    """A :class:`Pending` whose output is already queued on the device; ``result`` just hands it over."""

    def __init__(self, output: torch.Tensor) -> None:
        self._output = output

    def result(self) -> torch.Tensor:
        return self._output


class FiniteFlags:
    """Whether one layer call's inputs are finite: ``flags`` is a ``[2]`` bool tensor (hidden states, routing
    weights) reduced where they are, without a sync; the paradigm reads it on the host where it waits anyway (the
    routed counts, or the CPU worker's copy of the inputs) and calls :meth:`verify` before it computes."""

    WHAT = ("input hidden states", "routing weights (top_k_weights)")

    def __init__(self, layer: ExpertLayer, hidden: torch.Tensor, top_k_weights: torch.Tensor, step: int) -> None:
        self.layer, self.step, self.inputs = layer, step, (hidden, top_k_weights)
        self.flags = torch.stack([torch.isfinite(hidden).all(), torch.isfinite(top_k_weights).all()])  # [2]

    def verify(self, read: list) -> None:
        """Raises MoeccError when ``read`` (the flags as read on the host) says an input is not finite."""
        for ok, what, tensor in zip(read, self.WHAT, self.inputs):
            if not ok:
                count = int((~torch.isfinite(tensor)).sum())
                raise self.layer.non_finite(what, count, self.step, ", before the layer computed anything")


class _CheckedPending:
    """A :class:`Pending` whose output is checked for NaN / inf (``ExpertLayer.checked``)."""

    def __init__(self, pending: Pending, layer: ExpertLayer) -> None:
        self._pending, self._layer = pending, layer

    def result(self) -> torch.Tensor:
        output = self._pending.result()
        self._layer.check_finite("output", output)
        return output


def current_graph_task() -> int:
    """The autograd graph task this thread runs now, -1 outside the autograd engine's backward."""
    return current_graph_task_id()


def is_recomputing() -> bool:
    """Whether this forward runs inside backward: a checkpointed layer computing its saved tensors again."""
    return current_graph_task() != -1


def saved_state_gone(where: str) -> RuntimeError:
    """The error of a backward whose forward's saved state was already used (or never made)."""
    return RuntimeError(
        f"moecc: the {where} experts' saved activations are gone: they are released after the first backward "
        "through a graph (backward(retain_graph=True) cannot run a second time), or result() was never taken in "
        "forward. Run the forward pass again."
    )


def node_gradients(ctx, grad_hidden: torch.Tensor, grad_top_k_weights: torch.Tensor,
                   lora: tuple[ExpertLora | None, ExpertLora | None], lora_grads: LoraGrads) -> tuple:
    """An experts autograd node's gradients: hidden, routing weights, None for each non-tensor input between them
    and the LoRA factors (however many the node's ``forward`` took: counted from ``ctx``), then one per LoRA factor
    (``lora_tensors`` order), on each factor's device and in its dtype."""
    factors = factor_gradients(lora, lora_grads)
    skipped = len(ctx.needs_input_grad) - 2 - len(factors)
    return (grad_hidden, grad_top_k_weights, *([None] * skipped), *factors)


def routed_counts(top_k_index: torch.Tensor, num_experts: int, finite: FiniteFlags | None = None) -> list[int]:
    """``[E]`` routed pairs per expert on the host (one sync); ids outside ``[0, E)`` are refused first, then
    non-finite inputs where ``finite`` is given (its flags read in the same sync)."""
    flat = top_k_index.reshape(-1).long()
    bad = (flat < 0) | (flat >= num_experts)
    counts = torch.bincount(torch.where(bad, num_experts, flat), minlength=num_experts + 1)  # [E + 1]
    if finite is not None:
        counts = torch.cat([counts, finite.flags.long()])  # [E + 3]
    counts = counts.tolist()
    if counts[num_experts]:
        seen = flat[bad][:4].tolist()
        raise MoeccError(f"invalid routing: the router produced expert ids outside [0, {num_experts}) (e.g. {seen}); "
                         "check the model's router (num_experts in its config); nothing was computed or cached")
    if finite is not None:
        finite.verify(counts[num_experts + 1:])
    return counts[:num_experts]


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights that stay on the GPU whatever the paradigm: everything but the routed experts."""
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." not in n)


def expert_lora_params(layers: list) -> list[torch.nn.Parameter]:
    """The layers' expert LoRA factors (every adapter's), each once."""
    params = {id(p): p for layer in layers for wrapper in layer.wrappers.values()
              for name, p in wrapper.named_parameters() if "lora_" in name}
    return list(params.values())


class ExpertLayer(ABC):
    """One MoE layer's routed experts under a paradigm, with the PEFT wrappers that hold their LoRA."""

    def __init__(self, name: str, experts: torch.nn.Module, wrappers: dict, engine: Engine, index: int) -> None:
        self.name = name
        self.index = index  # position among the model's MoE layers
        self.experts = experts  # the Hugging Face experts module holding the host-resident weights
        self.wrappers = wrappers
        self.engine = engine

    def revision(self) -> tuple:
        """Changes when the host weights change: PEFT merges adapters into (or out of) them, or they are written
        in place (their version counters; a write through ``.data`` bypasses those and is not seen). Device and
        packed copies made under another revision are stale."""
        versions = tuple(p._version for p in self.experts.parameters(recurse=False))
        return merge_revision(self.wrappers), versions

    @property
    def weights(self) -> ExpertWeights:
        """The experts' current base weights in host memory (read at call time: PEFT's merge may replace or
        update them), keyed for backends that keep derived copies."""
        weights = expert_weights(self.experts)
        weights.cache_owner = self.experts
        weights.revision = self.revision()
        return weights

    def lora(self) -> tuple[ExpertLora | None, ExpertLora | None]:
        """(gate_up, down) LoRA factors PEFT would apply now, None where a projection applies none."""
        return layer_lora(self.wrappers)

    def begin_call(self, hidden: torch.Tensor) -> bool:
        """Starts a call of the layer; returns whether it is a recomputation. The first layer of a forward pass
        (not a recomputation) counts its tokens and tells the engine a pass begins."""
        recomputing = is_recomputing()
        if self.index == 0 and not recomputing:
            self.engine.metrics.tokens += hidden.shape[0]
            self.engine.forward_passes += 1
            # a training pass: gradients on, or a train-mode model's forward under reentrant checkpointing (no grad)
            self.engine.pass_begins(hidden.shape[0], torch.is_grad_enabled() or self.experts.training)
        return recomputing

    def check_inputs(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> FiniteFlags | None:
        """Refuses routing that does not fit ``hidden [T, H]`` (``top_k_index`` integer ``[T, k]``,
        ``top_k_weights`` the same shape); call before any state changes. Expert ids are checked by each paradigm
        where it reads them (``routed_counts``, or the CPU grouping), so no paradigm syncs twice. Under
        ``check_finite`` returns the inputs' :class:`FiniteFlags`, which the paradigm verifies in the same place
        (None: not checked)."""
        if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
            raise MoeccError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}; check the router")
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
            raise MoeccError(f"top_k_index has shape {tuple(top_k_index.shape)} for hidden states of shape "
                             f"{tuple(hidden.shape)}: it must be [tokens, top_k], one row per token; check the router")
        if top_k_weights.shape != top_k_index.shape:
            raise MoeccError(f"top_k_weights has shape {tuple(top_k_weights.shape)} but top_k_index has "
                             f"{tuple(top_k_index.shape)}: the router must give one weight per routed expert (both "
                             "[tokens, top_k]); check the router's outputs")
        if not (self.engine.check_finite or self.engine.check_every_tensor):
            return None
        step = self.engine.forward_passes + (self.index == 0 and not is_recomputing())  # the pass it begins
        return FiniteFlags(self, hidden.detach(), top_k_weights.detach(), step)

    def checked(self, pending: Pending) -> Pending:
        """``pending``, its output checked for NaN / inf at ``result()`` under ``check_finite="all"``."""
        return _CheckedPending(pending, self) if self.engine.check_every_tensor else pending

    def backward_lock(self) -> contextlib.AbstractContextManager:
        """Held around this layer's backward: nothing here; engines whose layers share state lock it."""
        return contextlib.nullcontext()

    def checked_backward(self, grad_out: torch.Tensor, backward: Callable[[], tuple]) -> tuple:
        """``backward()`` of this layer's autograd node under :meth:`backward_lock`, with the incoming gradient and
        the node's gradients checked under ``check_finite="all"``."""
        self.check_finite("incoming gradient (of the output)", grad_out)
        self.engine.backward_calls += 1
        with self.backward_lock():
            return self.check_gradients(backward())

    def check_gradients(self, gradients: tuple) -> tuple:
        """Under ``check_finite="all"``: the gradients an experts node returns (``node_gradients``) are finite."""
        self.check_finite("gradients (hidden states, routing weights, LoRA factors)",
                          *(g for g in gradients if isinstance(g, torch.Tensor)))
        return gradients

    def check_finite(self, what: str, *tensors: torch.Tensor | None, step: int | None = None) -> None:
        """Under ``check_finite="all"`` (``MoeccConfig``): raises MoeccError naming this layer and the step (forward
        pass) when one of ``tensors`` holds NaN or inf. A sync per tensor, so only where asked for."""
        if not self.engine.check_every_tensor:
            return
        for tensor in tensors:
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                count = int((~torch.isfinite(tensor)).sum())
                raise self.non_finite(what, count, self.engine.forward_passes if step is None else step)

    def non_finite(self, what: str, count: int, step: int, note: str = "") -> MoeccError:
        """The error for ``count`` NaN / inf values in this layer's ``what`` at forward pass ``step``."""
        return MoeccError(
            f"step {step} (forward pass): the {what} of MoE layer {self.index} ({self.name}) hold {count} "
            f"non-finite values (NaN or inf){note}; lower the learning rate, clip gradients or train in bfloat16 "
            "instead of float16 (MoeccConfig(check_finite=False) turns this check off)")

    @abstractmethod
    def submit(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Pending:
        """Starts the routed experts on ``hidden [T, H]`` (routing ``[T, k]``); queue independent device work,
        then call ``result()``."""


class Engine(ABC):
    """State shared by one model's layers under a paradigm; ``layers`` in model order."""

    name: ClassVar[str]  # the paradigm's name in ``moecc.paradigms.PARADIGMS``
    layer_class: ClassVar[type[ExpertLayer]]
    metrics: StepMetrics

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.metrics = StepMetrics()
        self.layers: list[ExpertLayer] = []
        self.forward_passes = 0  # forward passes begun (not recomputations): the step errors name
        self.backward_calls = 0  # layer backwards begun
        # MoeccConfig.check_finite: True checks every layer's inputs (and the loss); "all" (check_every_tensor) their
        # outputs and gradients too
        self.check_finite = False
        self.check_every_tensor = False

    @classmethod
    @abstractmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> Engine:
        """The engine ``moecc.prepare`` builds for ``device`` with ``config``'s options."""

    @classmethod
    def pool_threads(cls, device: torch.device) -> int | None:
        """The native pool's threads this paradigm wants on ``device`` where ``num_threads`` is not set (None:
        every CPU this process may use)."""
        return None

    def add_layer(self, name: str, experts: torch.nn.Module, wrappers: dict) -> ExpertLayer:
        """A new layer for one sparse block's base experts module and its PEFT wrappers (next in model order)."""
        layer = self.layer_class(name, experts, wrappers, self, len(self.layers))
        self.layers.append(layer)
        return layer

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        """Called once every layer and adapter exists, before the model moves to the device."""

    def pass_begins(self, tokens: int, training: bool = True) -> None:
        """Called by the first layer at the start of every forward pass (not recomputations) of ``tokens``;
        ``training``: gradients are on, or the model is in training mode (not an evaluation)."""

    def gpu_bytes(self, config: MoeccConfig) -> int:
        """Device memory this engine keeps beyond the non-expert weights (slots, caches), before activations."""
        return 0

    def budget_advice(self) -> str:
        """What to lower, besides the budget, when the GPU budget is too small (a clause, or "")."""
        return ""

    def describe(self) -> EngineDescription:
        """What runs where, for the summary line."""
        return EngineDescription()

    @abstractmethod
    def reset_metrics(self) -> None:
        """Starts a new measurement window for :meth:`metrics_since_reset`."""

    def metrics_since_reset(self) -> dict[str, float]:
        """Totals since the last reset, named for the machine at hand. Every paradigm reports ``cpu_experts_s``,
        ``tokens`` and ``routing_skew``; with a CUDA device ``h2d_gb`` / ``d2h_gb`` (copied over the link each
        way) and ``gpu_wait_s`` (the GPU's waits for the experts); without one nothing crosses a link, so the
        same counters are ``host_copy_in_gb`` / ``host_copy_out_gb`` (copies between host buffers) and
        ``expert_wait_s`` (the training thread's wait for expert results)."""
        counters = self.counters_since_reset()
        if self.device.type == "cuda":
            return counters
        return {HOST_NAMES.get(key, key): value for key, value in counters.items()}

    @abstractmethod
    def counters_since_reset(self) -> dict[str, float]:
        """The totals of :meth:`metrics_since_reset` under their CUDA names (``h2d_gb``, ``d2h_gb``,
        ``gpu_wait_s``) whatever the device: what an engine implements."""
