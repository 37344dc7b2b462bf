"""Whether the hybrid paradigm's splits pay over whole training steps: pure bookkeeping, no torch.

The split planner prices one layer pass at a time. What it cannot see shows only in whole steps: a CPU part's
chain on the critical path of the pass after it, the copy engine idle while the device waits for it. So for each
batch size (tokens per step, to the next power of two) the guard times a few steps with the planner's splits and
a few with every routed expert on the GPU (offload's way, in the same engine), alternating, keeps the faster, and
tries the other again after a while. Steps are timed from one training forward's start to the next's, so the
optimizer and the data loader count alike for both. Under gradient accumulation each micro-batch is such a step and
the optimizer's time falls in one of every few; with a LoRA optimizer on the GPU that is milliseconds against the
3% margin of a second-long step.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

SPLIT, GPU = "split", "gpu"


@dataclass
class _Bucket:
    """One batch size's timed steps per mode, and the mode chosen from them (None while trying both)."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {SPLIT: [], GPU: []})
    begun: dict[str, int] = field(default_factory=lambda: {SPLIT: 0, GPU: 0})
    chosen: str | None = None
    steps_since_choice: int = 0
    steps: int = 0


@dataclass
class StepGuard:
    """Chooses per batch size between the planner's splits (``"split"``) and every expert on the GPU (``"gpu"``)
    from timed steps. ``seconds_between(begin, end)`` reads two marks (clock readings, or CUDA events: those are
    read once ``done(end)`` says they completed, so timing never waits for the device)."""

    seconds_between: Callable[[object, object], float]
    done: Callable[[object], bool] = lambda mark: True
    trials: int = 1  # timed steps of each mode before choosing (moecc bench times steps after 4 warm-up steps)
    margin: float = 0.03  # the GPU alone must be this much faster to replace the splits (run-to-run noise)
    retry_after: int = 200  # steps in the chosen mode before both are tried again (the routing drifts as it trains)
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    _open: tuple | None = None  # (bucket, mode, mark) of the training step running now
    _pending: list = field(default_factory=list)  # (bucket, mode, begin, end) not yet read

    def step_begins(self, tokens: int, mark: object, training: bool) -> str:
        """A forward pass of ``tokens`` begins at ``mark``; returns the mode it runs in. Only training passes are
        timed, each up to the next training pass; an evaluation in between leaves the step before it untimed, and
        that mode is tried again."""
        if self._open is not None:
            bucket, mode, begin = self._open
            if training:  # the step before ran alone, up to this mark (whatever this step's size)
                self._pending.append((bucket, mode, begin, mark))
            else:  # an evaluation ran in it: untimed, so that mode's trial is owed again
                self.buckets[bucket].begun[mode] -= 1
            self._open = None
        self._read()
        bucket = self.buckets.setdefault(size_bucket(tokens), _Bucket())
        if not training:
            return bucket.chosen or SPLIT
        mode = self._mode(bucket)
        bucket.steps += 1
        if bucket.steps > 1:  # a batch size's first step grows buffers and loads kernels: not timed
            self._open = (size_bucket(tokens), mode, mark)
            bucket.begun[mode] += 1
        return mode

    def _mode(self, bucket: _Bucket) -> str:
        if bucket.chosen is not None:
            bucket.steps_since_choice += 1
            if bucket.steps_since_choice <= self.retry_after:
                return bucket.chosen
            bucket.seconds, bucket.begun = {SPLIT: [], GPU: []}, {SPLIT: 0, GPU: 0}
            bucket.chosen, bucket.steps_since_choice = None, 0
        if bucket.steps == 0:
            return SPLIT
        if min(bucket.begun.values()) < self.trials:  # the mode with fewer timed steps, the splits first
            return GPU if bucket.begun[GPU] < bucket.begun[SPLIT] else SPLIT
        return SPLIT  # both tried: the splits until the last timings are read

    def _read(self) -> None:
        """Folds in the timed steps whose end marks completed; chooses where a batch size has enough."""
        waiting = []
        for bucket, mode, begin, end in self._pending:
            if not self.done(end):
                waiting.append((bucket, mode, begin, end))
                continue
            state = self.buckets[bucket]
            state.seconds[mode].append(self.seconds_between(begin, end))
            if state.chosen is None and all(len(s) >= self.trials for s in state.seconds.values()):
                split, gpu = (statistics.median(state.seconds[m]) for m in (SPLIT, GPU))
                state.chosen = GPU if gpu < split * (1 - self.margin) else SPLIT
                state.steps_since_choice = 0
        self._pending = waiting


def size_bucket(tokens: int) -> int:
    """Tokens per step to the next power of two: batches of about one size share their timings."""
    return 1 << max(0, int(tokens) - 1).bit_length()
