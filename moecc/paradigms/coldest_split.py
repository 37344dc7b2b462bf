"""A split policy with no cost model: each layer's least-routed experts go to the CPU, up to a share of the bytes
of its routed experts' weights; the rest, and every expert's backward where its forward ran, on the GPU.

A baseline for the planner (``moecc bench --split-policy coldest:0.25``): it needs no rates, so it shows what
balancing from measured costs adds over a fixed rule of thumb.
"""
from __future__ import annotations

import torch

from .hybrid_split import RoutingForecast
from .split_policy import SplitPolicy


class ColdestToCpu(SplitPolicy):
    """The coldest routed experts on the CPU while their weights stay within ``share`` of the routed experts'."""

    name = "coldest"

    def __init__(self, share: float = 0.25) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the coldest policy's byte share must be in [0, 1], got {share}; e.g. 'coldest:0.25'")
        self.share = share
        self.forecast = RoutingForecast()
        self._expert_bytes: list[int] = []  # per layer: one expert's weights

    def start(self, device: torch.device, layers: list) -> None:
        self._expert_bytes = [layer.weights.gate_up[0].nbytes + layer.weights.down[0].nbytes for layer in layers]

    def _gpu(self, index: int, counts) -> tuple[int, ...]:
        routed = sorted((e for e, n in enumerate(counts) if n > 0), key=lambda e: (counts[e], e))
        size = self._expert_bytes[index] if index < len(self._expert_bytes) else 1
        budget = self.share * size * len(routed)
        on_cpu = 0
        while on_cpu < len(routed) and (on_cpu + 1) * size <= budget:
            on_cpu += 1
        return tuple(sorted(routed[on_cpu:]))

    def forward(self, layer, counts: list[int], resident: set[int], committed: set[int]) -> tuple[int, ...]:
        return self._gpu(layer.index, counts)

    def prefetch(self, index: int, resident: set[int]) -> tuple[int, ...] | None:
        expected = self.forecast.expected(index)
        return None if expected is None else self._gpu(index, [n if n >= 0.5 else 0.0 for n in expected])

    def layer_ran(self, index: int, counts: list[int], cpu: bool, cpu_backward: bool) -> None:
        self.forecast.observe(index, counts)
