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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from ..config import MoeccConfig
from ..experts import ExpertLora, ExpertWeights, LoraGrads
from ..lora import factor_gradients, layer_lora, merge_revision
from ..store import expert_weights

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
    expert_token_counts: list = field(default_factory=list)  # one [E] list (or device tensor) per layer call

    def reset(self) -> None:
        self.cpu_forward_s = self.cpu_backward_s = self.wait_s = 0.0
        self.tokens = self.tokens_routed = 0
        self.expert_token_counts = []

    @property
    def routing_skew(self) -> float:
        """Mean over layer calls of (most tokens on one expert) / (mean tokens per expert); 1 is perfectly even."""
        counts = [c.tolist() if isinstance(c, torch.Tensor) else c for c in self.expert_token_counts]
        skews = [max(c) * len(c) / sum(c) for c in counts if sum(c) > 0]
        return sum(skews) / len(skews) if skews else 0.0


class Pending(Protocol):
    """What ``ExpertLayer.submit`` returns: ``result()`` is the routed-expert output ``[T, H]`` on the device."""

    def result(self) -> torch.Tensor: ...


class Ready:
    """A :class:`Pending` whose output is already queued on the device; ``result`` just hands it over."""

    def __init__(self, output: torch.Tensor) -> None:
        self._output = output

    def result(self) -> torch.Tensor:
        return self._output


def is_recomputing() -> bool:
    """Whether this forward runs inside backward: a checkpointed layer computing its saved tensors again."""
    return torch._C._current_graph_task_id() != -1


def saved_state_gone(where: str) -> RuntimeError:
    """The error of a backward whose forward's saved state was already used (or never made)."""
    return RuntimeError(
        f"moecc: the {where} experts' saved activations are gone: they are released after the first backward "
        "through a graph (backward(retain_graph=True) cannot run a second time), or result() was never taken in "
        "forward. Run the forward pass again."
    )


def node_gradients(grad_hidden: torch.Tensor, grad_top_k_weights: torch.Tensor, skipped: int,
                   lora: tuple[ExpertLora | None, ExpertLora | None], lora_grads: LoraGrads) -> tuple:
    """An experts autograd node's gradients: hidden, routing weights, None for its ``skipped`` non-tensor inputs,
    then one per LoRA factor (``lora_tensors`` order), on each factor's device and in its dtype."""
    return (grad_hidden, grad_top_k_weights, *([None] * skipped), *factor_gradients(lora, lora_grads))


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
        """Changes when PEFT merges adapters into (or out of) the host weights."""
        return merge_revision(self.wrappers)

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
            self.engine.pass_begins()
        return recomputing

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

    @classmethod
    @abstractmethod
    def from_config(cls, device: torch.device, config: MoeccConfig) -> Engine:
        """The engine ``moecc.prepare`` builds for ``device`` with ``config``'s options."""

    def add_layer(self, name: str, experts: torch.nn.Module, wrappers: dict) -> ExpertLayer:
        """A new layer for one sparse block's base experts module and its PEFT wrappers (next in model order)."""
        layer = self.layer_class(name, experts, wrappers, self, len(self.layers))
        self.layers.append(layer)
        return layer

    def finish(self, model: torch.nn.Module, config: MoeccConfig) -> None:
        """Called once every layer and adapter exists, before the model moves to the device."""

    def pass_begins(self) -> None:
        """Called by the first layer at the start of every forward pass (not recomputations)."""

    def gpu_bytes(self, config: MoeccConfig) -> int:
        """Device memory this engine keeps beyond the non-expert weights (slots, caches), before activations."""
        return 0

    def budget_advice(self) -> str:
        """What to lower, besides the budget, when the GPU budget is too small (a clause, or "")."""
        return ""

    @abstractmethod
    def reset_metrics(self) -> None:
        """Starts a new measurement window for :meth:`metrics_since_reset`."""

    @abstractmethod
    def metrics_since_reset(self) -> dict[str, float]:
        """Totals since the last reset; every paradigm reports ``cpu_experts_s``, ``h2d_gb``, ``d2h_gb``,
        ``gpu_wait_s``, ``tokens`` and ``routing_skew``."""
