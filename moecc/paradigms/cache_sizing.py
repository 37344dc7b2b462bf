"""How much device memory the expert cache may take at each batch size, under ``offload_cache_gb="auto"``: pure
bookkeeping, no torch.

What a training pass needs besides the cache (weights, slots, activations, the loss's logits, the optimizer's
state) grows with its tokens, so a fixed cache either wastes the memory small batches leave or runs large ones out
of memory. The engine reports each pass's peak device memory, less what the cache held meanwhile, under the pass's
batch size (tokens to the next power of two); the cache then gets the budget minus the largest such peak of that
size and a margin for the allocator's fragmentation. A batch size not seen yet runs its first pass without a cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 0.12  # of the limit, kept free: the allocator rounds and splits blocks, and peaks vary between passes


@dataclass
class CacheSizer:
    """Cache budgets per batch size within ``limit_bytes`` (the GPU budget, or the device's memory)."""

    limit_bytes: int
    margin: float = MARGIN
    peaks: dict[int, int] = field(default_factory=dict)  # batch size bucket -> most bytes a pass used besides the cache

    def observe(self, bucket: int, peak_bytes: int, cache_bytes: int) -> None:
        """A pass of ``bucket`` peaked at ``peak_bytes`` while the cache held ``cache_bytes``."""
        used = max(0, int(peak_bytes) - int(cache_bytes))
        self.peaks[bucket] = max(self.peaks.get(bucket, 0), used)

    def budget(self, bucket: int) -> int:
        """Bytes the cache may hold during a pass of ``bucket``: 0 until a pass of that size was seen."""
        if bucket not in self.peaks:
            return 0
        return max(0, int(self.limit_bytes * (1 - self.margin)) - self.peaks[bucket])
