"""Where routed-expert math runs: ``cocompute`` (on the CPU, in place), ``offload`` (on the device, after
copying the weights there) or ``hybrid`` (both at once, each layer's experts split between them). Every paradigm implements :mod:`.base`; ``PARADIGMS`` is the one registry
``moecc.prepare`` looks names up in."""
from __future__ import annotations

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


__all__ = ["PARADIGMS", "Engine", "ExpertLayer", "StepMetrics", "engine_class"]
