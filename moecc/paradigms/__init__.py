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

    Without a CUDA device only co-compute applies (the experts' math on the CPU either way). With one, offload:
    on the accelerator host it beat co-compute at every batch and hybrid too, so far
    (``benchmarks/results/hybrid_2026-12-02``); hybrid is there to be chosen by name, and ``moecc bench`` /
    ``moecc plan`` compare all three on this machine."""
    if paradigm != "auto":
        return paradigm
    if device.type != "cuda":
        choice, why = "cocompute", "no CUDA device, so the experts run on the CPU"
    else:
        choice, why = "offload", ("a CUDA device: copying the experts to the GPU beat computing them on the CPU, "
                                  "and splitting them (paradigm='hybrid'), in every measured batch so far; "
                                  "`moecc bench` compares the three on this machine")
    logging.getLogger("moecc").info("paradigm='auto' chose %r: %s", choice, why)
    return choice


__all__ = ["PARADIGMS", "Engine", "ExpertLayer", "StepMetrics", "choose_paradigm", "engine_class"]
