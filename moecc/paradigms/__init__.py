"""Where routed-expert math runs: ``cocompute`` (on the CPU, in place), ``offload`` (on the device, after
copying the weights there) or ``hybrid`` (both at once, each layer's experts split between them). Every paradigm implements :mod:`.base`; ``PARADIGMS`` is the one registry
``moecc.prepare`` looks names up in."""
from __future__ import annotations

import logging

import torch

from ..errors import MoeccError
from .base import Engine, ExpertLayer, StepMetrics
from .cocompute import CoComputeEngine
from .hybrid import HybridEngine
from .offload import OffloadEngine

PARADIGMS: dict[str, type[Engine]] = {engine.name: engine for engine in (CoComputeEngine, OffloadEngine, HybridEngine)}


def engine_class(paradigm: str) -> type[Engine]:
    """The engine class registered as ``paradigm``, or an error listing the ones there are."""
    if paradigm not in PARADIGMS:
        raise MoeccError(f"paradigm {paradigm!r} is not available; choose one of {', '.join(PARADIGMS)}")
    return PARADIGMS[paradigm]


def choose_paradigm(paradigm: str, device: torch.device, model_config=None, offload_slots: int = 2) -> str:
    """``paradigm`` itself, or for ``"auto"`` the one to run, logged in one line with the reason on logger
    ``moecc``.

    Without a CUDA device only co-compute applies (the experts' math on the CPU either way). With one, the
    planner's choice (``moecc.bench.plan.auto_paradigm``) from the rates ``moecc plan`` / ``moecc bench`` measured
    and cached on this machine, for a model of ``model_config``'s shape (a transformers config). Without such
    rates, offload: it beat co-compute at every batch measured on an H100/H200 machine with a 16-core Xeon."""
    if paradigm != "auto":
        return paradigm
    picked = None
    if device.type != "cuda":
        picked = "cocompute", "no CUDA device, so the experts run on the CPU"
    elif model_config is not None:
        from ..bench.plan import auto_paradigm  # the planner: pure arithmetic over the cached rates
        from ..bench.rates_cache import cached

        rates = cached()
        picked = auto_paradigm(model_config, rates, offload_slots) if rates is not None else None
    if picked is None:
        picked = "offload", ("a CUDA device and no rates of this model's shape measured on this machine (`moecc plan "
                             "--preset NAME` measures a preset's): copying the experts to the GPU beat computing "
                             "them on the CPU at every batch measured on an H100/H200 machine")
    choice, why = picked
    logging.getLogger("moecc").info("paradigm='auto' chose %r: %s", choice, why)
    return choice


__all__ = ["PARADIGMS", "Engine", "ExpertLayer", "StepMetrics", "choose_paradigm", "engine_class"]
