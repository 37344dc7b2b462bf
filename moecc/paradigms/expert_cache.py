"""Offload's optional device-resident cache of the most frequently routed experts.

Routing is skewed: a few experts of each layer take many of the tokens. Keeping device copies of the hottest
(layer, expert) pairs, within a byte budget, lets the offload engine fill a slot from them with a
device-to-device copy instead of crossing PCIe again. Popularity is counted from the routing of every forward;
the cache is refilled from those counts when a new forward pass begins, so it follows the data. Copies made
under an older PEFT merge state are never served.
"""
from __future__ import annotations

from collections import Counter

import torch


class ExpertCache:
    """Device copies of hot experts within ``budget_bytes``; ``take`` serves them, ``observe`` counts routing."""

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        self.device = device
        self.budget_bytes = int(budget_bytes)
        self.entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        self.counts: Counter = Counter()  # (layer, expert) -> tokens routed there so far
        self._pending: list[tuple[int, object]] = []  # (layer, [E] counts, maybe still on the device)
        self.hits = 0  # experts served from the cache
        self.hit_bytes = 0

    @property
    def bytes(self) -> int:
        return sum(g.nbytes + d.nbytes for g, d, _ in self.entries.values())

    def observe(self, layer: int, token_counts) -> None:
        """Notes one forward's tokens per expert of ``layer`` (a list, or a device tensor read at refill)."""
        self._pending.append((layer, token_counts))

    def refill(self, layers: list) -> None:
        """Folds the routing seen since the last refill into the counts, then keeps the hottest pairs that fit."""
        for layer, counts in self._pending:
            values = counts.tolist() if isinstance(counts, torch.Tensor) else counts
            for expert, count in enumerate(values):
                if count:
                    self.counts[(layer, expert)] += int(count)
        self._pending = []
        if not self.counts or self.budget_bytes <= 0:
            return
        wanted, used = [], 0
        for key, _ in self.counts.most_common():
            weights = layers[key[0]].weights
            size = weights.gate_up[key[1]].nbytes + weights.down[key[1]].nbytes
            if used + size > self.budget_bytes:
                continue  # a smaller expert of another layer may still fit
            wanted.append(key)
            used += size
        keep = set(wanted)
        for key in [k for k in self.entries if k not in keep]:
            del self.entries[key]
        for layer_index, expert in wanted:
            layer = layers[layer_index]
            revision = layer.revision()
            entry = self.entries.get((layer_index, expert))
            if entry is None or entry[2] != revision:
                weights = layer.weights
                self.entries[(layer_index, expert)] = (weights.gate_up[expert].to(self.device, copy=True),
                                                       weights.down[expert].to(self.device, copy=True), revision)

    def holds(self, layer: int, expert: int, revision: tuple) -> bool:
        """Whether a current copy of ``expert`` is cached (without counting a hit)."""
        entry = self.entries.get((layer, expert))
        return entry is not None and entry[2] == revision

    def take(self, layer: int, expert: int, revision: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cached (gate_up, down) of ``expert`` if they are current, counting the hit; else None."""
        if not self.holds(layer, expert, revision):
            return None
        entry = self.entries[(layer, expert)]
        self.hits += 1
        self.hit_bytes += entry[0].nbytes + entry[1].nbytes
        return entry[0], entry[1]
