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


def choose_paradigm(paradigm: str, device: torch.device) -> str:
    """``paradigm`` itself, or for ``"auto"`` the one to run, logged with the reason on logger ``moecc``.

    Without a CUDA device only co-compute applies (the experts' math on the CPU either way). With one, hybrid: it
    plans each layer pass from the rates it measures while running, and where a split does not pay the pass runs
    wholly on the better side, so it is never meant to lose to either pure paradigm (``moecc plan`` predicts all
    three on this machine)."""
    if paradigm != "auto":
        return paradigm
    if device.type != "cuda":
        choice, why = "cocompute", "no CUDA device, so the experts run on the CPU"
    else:
        choice, why = "hybrid", ("a CUDA device: each layer's experts are split between the GPU and the CPU from "
                                 "rates measured as it runs, wholly on one side where a split does not pay")
    logging.getLogger("moecc").info("paradigm='auto' chose %r: %s", choice, why)
    return choice


__all__ = ["PARADIGMS", "Engine", "ExpertLayer", "StepMetrics", "choose_paradigm", "engine_class"]
