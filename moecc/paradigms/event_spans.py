"""Metrics that accumulate over a run without growing with it.

Engines record timing events around every copy and computation and routing counts for every layer call, and sum
them only when someone reads the metrics. A loop that never reads or resets them (a plain training script) kept one
entry per call for ever: about 5 KB of host memory per step on two layers, and a CUDA event pair per copy. These
hold their entries up to a bound, then fold the finished ones into a running total.
"""
from __future__ import annotations

import torch

FOLD_AT = 512  # entries held before the finished ones are folded


def timed_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on ``stream`` now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class EventSpans:
    """Summed seconds between ``(begin, end)`` pairs of timing CUDA events (anything with ``query``,
    ``synchronize`` and ``elapsed_time``). Pairs whose end has completed are folded once more than ``FOLD_AT`` are
    held; ``seconds`` waits for the rest."""

    def __init__(self) -> None:
        self._pairs: list[tuple] = []
        self._folded_s = 0.0
        self._last: tuple | None = None
        self.added = 0  # pairs ever added (a position that folding does not move)

    def add(self, begin, end) -> None:
        self._pairs.append((begin, end))
        self._last = (begin, end)
        self.added += 1
        if len(self._pairs) > FOLD_AT:
            self._fold(wait=False)

    def last(self) -> tuple | None:
        """The pair added last (folded or not), or None if none was added since the last :meth:`reset`."""
        return self._last

    def _fold(self, wait: bool) -> None:
        kept = []
        for begin, end in self._pairs:
            if wait:
                end.synchronize()
            elif not end.query():
                kept.append((begin, end))
                continue
            self._folded_s += begin.elapsed_time(end) / 1e3  # milliseconds
        self._pairs = kept

    def seconds(self) -> float:
        """Seconds over every pair added since the last :meth:`reset` (waits for the unfinished ones)."""
        self._fold(wait=True)
        return self._folded_s

    def held(self) -> int:
        """Pairs held unfolded now."""
        return len(self._pairs)

    def reset(self) -> None:
        self._pairs, self._folded_s, self._last = [], 0.0, None


class RoutingSkew:
    """Mean over layer calls of (most pairs on one expert) / (mean pairs per expert), from ``[E]`` counts given as
    lists or (device) tensors; tensors are read only once ``FOLD_AT`` are held, or when the mean is asked for, so
    recording one does not sync with the device."""

    def __init__(self) -> None:
        self._held: list = []
        self._sum = 0.0
        self._calls = 0
        self._pairs = 0

    def add(self, counts) -> None:
        self._held.append(counts)
        if len(self._held) > FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        tensors = [c for c in self._held if isinstance(c, torch.Tensor)]
        lists = [c for c in self._held if not isinstance(c, torch.Tensor)]
        if tensors and len({(t.numel(), t.device) for t in tensors}) == 1:  # one read, one sync, for them all
            lists += torch.stack([t.reshape(-1) for t in tensors]).tolist()
        else:
            lists += [t.tolist() for t in tensors]
        for counts in lists:
            total = sum(counts)
            self._pairs += total
            if total > 0:
                self._sum += max(counts) * len(counts) / total
                self._calls += 1
        self._held = []

    def mean(self) -> float:
        """The mean skew over the calls with any pair; 0.0 when there were none."""
        self._fold()
        return self._sum / self._calls if self._calls else 0.0

    def calls(self) -> int:
        """Layer calls recorded with any pair."""
        self._fold()
        return self._calls

    def pairs(self) -> int:
        """Routed pairs over every recorded call."""
        self._fold()
        return int(self._pairs)

    def held(self) -> int:
        return len(self._held)
