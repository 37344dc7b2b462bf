"""Offload's optional device-resident cache of the most frequently routed experts.

Routing is skewed: a few experts of each layer take many of the tokens. Keeping device copies of the hottest
(layer, expert) pairs, within a byte budget, lets the offload engine fill a slot from them with a
device-to-device copy instead of crossing PCIe again. Popularity is counted from the routing of every forward;
the cache is refilled from those counts when a new forward pass begins, so it follows the data. Copies made
under an older PEFT merge state are never served.

The copies live in equal slots carved from a few large chunks rather than one allocation each: thousands of
small blocks would fragment the allocator's pool beside the activations, and a budget that shrinks (see
``moecc.paradigms.cache_sizing``) frees whole chunks while the slots in the chunks kept still hold their experts.
"""
from __future__ import annotations

from collections import Counter

import torch

CHUNK_BYTES = 512 * 2**20  # a shrinking budget frees memory in steps of about this much
_ALIGN = 256


class ExpertCache:
    """Device copies of hot experts within ``budget_bytes``; ``take`` serves them, ``observe`` counts routing."""

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        self.device = device
        self.budget_bytes = int(budget_bytes)
        self.entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        self.counts: Counter = Counter()  # (layer, expert) -> tokens routed there so far
        self._pending: list[tuple[int, object]] = []  # (layer, [E] counts, maybe still on the device)
        self._chunks: list[torch.Tensor] = []  # uint8 device buffers of ``_per_chunk`` slots each
        self._slot_bytes = 0
        self._per_chunk = 0
        self._total_experts = 0
        self._slot_of: dict[tuple[int, int], int] = {}
        self.hits = 0  # experts served from the cache
        self.hit_bytes = 0

    @property
    def bytes(self) -> int:
        """Device memory the cache holds (its chunks, used or not)."""
        return sum(chunk.nbytes for chunk in self._chunks)

    def observe(self, layer: int, token_counts) -> None:
        """Notes one forward's tokens per expert of ``layer`` (a list, or a device tensor read at refill)."""
        self._pending.append((layer, token_counts))

    def resize(self, budget_bytes: int) -> None:
        """Sets the budget the next refill fills; a smaller one frees the chunks past it now, dropping only the
        experts they held."""
        self.budget_bytes = max(0, int(budget_bytes))
        if not self._per_chunk:
            return
        slots = self._slots_within(self.budget_bytes)
        for index, chunk in enumerate(self._chunks):  # the first chunk past the budget, or cut larger than it
            if chunk.nbytes > max(0, min(self._per_chunk, slots - index * self._per_chunk)) * self._slot_bytes:
                self._drop_chunks(index)
                break

    def refill(self, layers: list, reader: torch.cuda.Stream | None = None) -> None:
        """Folds the routing seen since the last refill into the counts, then keeps the hottest pairs that fit.
        ``reader``: the stream that copies from the cache; a slot is written again only after its work so far."""
        for layer, counts in self._pending:
            values = counts.tolist() if isinstance(counts, torch.Tensor) else counts
            for expert, count in enumerate(values):
                if count:
                    self.counts[(layer, expert)] += int(count)
        self._pending = []
        if not self.counts or not layers:
            return
        if not self._slot_bytes:
            self._lay_out(layers)
        slots = self._slots_within(self.budget_bytes)
        wanted = [key for key, _ in self.counts.most_common(slots)]
        keep = set(wanted)
        for key in [k for k in self.entries if k not in keep]:
            del self.entries[key], self._slot_of[key]
        if not wanted:
            return
        self._grow(len(wanted))
        free = sorted(set(range(self._capacity())) - set(self._slot_of.values()), reverse=True)
        for layer_index, expert in wanted:
            layer = layers[layer_index]
            revision = layer.revision()
            entry = self.entries.get((layer_index, expert))
            if entry is not None and entry[2] == revision:
                continue
            slot = self._slot_of.get((layer_index, expert))
            if slot is None:
                slot = self._slot_of[(layer_index, expert)] = free.pop()
            if reader is not None:  # only a pass that writes a slot waits, and once
                torch.cuda.current_stream(self.device).wait_stream(reader)
                reader = None
            weights = layer.weights
            gate_up, down = self._views(slot, weights.gate_up[expert], weights.down[expert])
            gate_up.copy_(weights.gate_up[expert])  # blocking: served by the copy stream right after
            down.copy_(weights.down[expert])
            self.entries[(layer_index, expert)] = (gate_up, down, revision)

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

    def _lay_out(self, layers: list) -> None:
        """Slot size: the largest expert's two matrices, each starting aligned."""
        self._slot_bytes = max(_aligned(layer.weights.gate_up[0].nbytes) + _aligned(layer.weights.down[0].nbytes)
                               for layer in layers)
        self._per_chunk = max(1, CHUNK_BYTES // self._slot_bytes)
        self._total_experts = sum(layer.weights.num_experts for layer in layers)

    def _slots_within(self, budget: int) -> int:
        """Slots whose chunks fit ``budget`` (a last, partial chunk only as large as needed), at most one per
        expert of the model."""
        if not self._slot_bytes:
            return 0
        return min(budget // self._slot_bytes, self._total_experts)

    def _grow(self, slots: int) -> None:
        """Chunks for at least ``slots`` slots: full ones, then a last one cut to what is left (a cut chunk too
        small for the slots asked now is dropped, with the experts it held, and allocated again larger)."""
        for index in range(-(-slots // self._per_chunk)):
            size = min(self._per_chunk, slots - index * self._per_chunk) * self._slot_bytes
            if index < len(self._chunks):
                if self._chunks[index].nbytes >= size:
                    continue
                self._drop_chunks(index)
            self._chunks.append(torch.empty(size, dtype=torch.uint8, device=self.device))

    def _capacity(self) -> int:
        return sum(chunk.nbytes // self._slot_bytes for chunk in self._chunks)

    def _drop_chunks(self, first: int) -> None:
        """Frees chunk ``first`` and those after it, forgetting the experts they held."""
        del self._chunks[first:]
        for key in [k for k, slot in self._slot_of.items() if slot // self._per_chunk >= first]:
            del self.entries[key], self._slot_of[key]

    def _views(self, slot: int, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s memory as tensors shaped like one expert's ``gate_up`` and ``down``."""
        chunk = self._chunks[slot // self._per_chunk]
        start = (slot % self._per_chunk) * self._slot_bytes
        split = start + _aligned(gate_up.nbytes)
        return (chunk[start:start + gate_up.nbytes].view(gate_up.dtype).view(gate_up.shape),
                chunk[split:split + down.nbytes].view(down.dtype).view(down.shape))


class CudaPeakMemory:
    """The allocator's peak on ``device`` since the last ``reset`` (which resets the allocator's own peak
    statistics, as ``torch.cuda.reset_peak_memory_stats`` does)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
