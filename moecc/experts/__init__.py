"""Routed-expert math with LoRA: the value types every backend shares and the three backends.

- :mod:`.reference`: the slow, obviously-correct oracle (bit-exact with HF + PEFT), any device.
- :mod:`.grouped`: grouped matrix products (``torch._grouped_mm``), LoRA factorised; the device-side math.
- :mod:`.native`: the C++ kernels on host-resident bf16 weights; the CPU-side math.

All three implement :class:`ExpertBackend` (``forward`` / ``backward``), for every expert of a layer or for a
subset of them (``expert_mask`` or ``grouping``), whose partial results over a partition sum to the whole.
:mod:`.select` picks one from ``MoeccConfig``'s names.
"""
from .grouping import Grouping, group_by_expert
from .types import ExpertBackend, ExpertLora, ExpertWeights, LoraGrads, SavedState

__all__ = ["ExpertBackend", "ExpertLora", "ExpertWeights", "Grouping", "LoraGrads", "SavedState",
           "group_by_expert"]
