"""How much device memory the expert cache may take at each batch size, under ``offload_cache_gb="auto"``: pure
bookkeeping, no torch.

What a training pass needs besides the cache (weights, slots, activations, the loss's logits, the optimizer's
state) grows with its tokens, so a fixed cache either wastes the memory small batches leave or runs large ones out
of memory. The engine reports the peak device memory from each forward pass's start to the next's, less what the
cache held meanwhile, under the pass's batch size (tokens to the next power of two); the cache then gets the limit
less the largest such peak of that size and a margin for the allocator's rounding. A pass runs without a cache
until a pass of its size with at least as many tokens and a backward was measured: a forward without gradients (an
evaluation, a DPO reference forward) keeps few activations, and a batch size spans up to twice the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .step_guard import size_bucket

MARGIN = 0.12  # of the limit, kept free: the allocator rounds and splits blocks, and peaks vary between passes


@dataclass
class CacheSizer:
    """Cache budgets per batch size within ``limit_bytes`` (the GPU budget, or the device's memory)."""

    limit_bytes: int
    margin: float = MARGIN
    peaks: dict[int, int] = field(default_factory=dict)  # bucket -> most bytes a pass used besides the cache
    trained: dict[int, int] = field(default_factory=dict)  # bucket -> most tokens of a measured pass with a backward

    def observe(self, tokens: int, peak_bytes: int, cache_bytes: int, backward: bool) -> None:
        """A pass of ``tokens`` (with a backward in its span, or not) peaked at ``peak_bytes`` while the cache held
        ``cache_bytes``."""
        bucket = size_bucket(tokens)
        self.peaks[bucket] = max(self.peaks.get(bucket, 0), max(0, int(peak_bytes) - int(cache_bytes)))
        if backward:
            self.trained[bucket] = max(self.trained.get(bucket, 0), int(tokens))

    def budget(self, tokens: int) -> int:
        """Bytes the cache may hold during a pass of ``tokens``: 0 until a pass with a backward and at least as many
        tokens of its batch size was measured."""
        bucket = size_bucket(tokens)
        if tokens > self.trained.get(bucket, 0):
            return 0
        return max(0, int(self.limit_bytes * (1 - self.margin)) - self.peaks[bucket])
