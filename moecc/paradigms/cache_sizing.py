"""How much device memory the expert cache may take at each batch size, under ``offload_cache_gb="auto"``: pure
bookkeeping, no torch.

What a training pass needs besides the cache (weights, slots, activations, the loss's logits, the optimizer's
state) grows with its tokens, so a fixed cache either wastes the memory small batches leave or runs large ones out
of memory. The engine reports the peak device memory from each forward pass's start to the next's (a span), less
what the cache held meanwhile, under the pass's batch size (tokens to the next power of two); the cache then gets
the limit less the largest such peak of that size and a margin for the allocator's rounding.

A training pass runs without a cache until a pass of at least its tokens was measured together with its backward:
a forward alone (a DPO reference forward, one of several whose summed loss is differentiated later) keeps fewer
activations than it holds once the backward runs. A span with a backward also counts for the training forwards
since the last such span, whose activations it held. An evaluation pass needs only a measured forward of at least
its tokens. Passes of fewer tokens than one measured, of their size or a larger one, use that size's peak.
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
    peaks: dict[int, int] = field(default_factory=dict)  # bucket -> most bytes a span used besides the cache
    trained: dict[int, int] = field(default_factory=dict)  # bucket -> most tokens measured with their backward
    evaluated: dict[int, int] = field(default_factory=dict)  # bucket -> most tokens of a measured forward
    _waiting: dict[int, int] = field(default_factory=dict)  # bucket -> most tokens of training forwards whose
    # backward has not run (a bucket's largest stands for the rest; bounded however long no backward comes)

    def observe(self, tokens: int, peak_bytes: int, cache_bytes: int, backward: bool, training: bool = True) -> None:
        """A span begun by a pass of ``tokens`` (``training``: with gradients or in train mode) peaked at
        ``peak_bytes`` while the cache held ``cache_bytes``; ``backward``: a layer backward ran in it."""
        used = max(0, int(peak_bytes) - int(cache_bytes))
        self._file(tokens, used, self.evaluated)
        if backward:
            for earlier in [*self._waiting.values(), tokens]:  # their activations were alive until this backward
                self._file(earlier, used, self.trained)
            self._waiting = {}
        elif training:
            bucket = size_bucket(tokens)
            self._waiting[bucket] = max(self._waiting.get(bucket, 0), int(tokens))

    def budget(self, tokens: int, training: bool = True) -> int:
        """Bytes the cache may hold during a pass of ``tokens``: 0 until a span that covers it was measured (see
        the module docstring)."""
        measured = self.trained if training else {b: max(t, self.trained.get(b, 0))
                                                  for b, t in self.evaluated.items()}
        covering = [self.peaks[b] for b, most in measured.items() if most >= tokens and b >= size_bucket(tokens)]
        if not covering:
            return 0
        return max(0, int(self.limit_bytes * (1 - self.margin)) - min(covering))

    def _file(self, tokens: int, used: int, measured: dict[int, int]) -> None:
        bucket = size_bucket(tokens)
        self.peaks[bucket] = max(self.peaks.get(bucket, 0), used)
        measured[bucket] = max(measured.get(bucket, 0), int(tokens))
