"""The hybrid paradigm's step guard: per batch size, whole steps timed with the splits and with every expert on the
GPU, the faster kept; marks read only once complete."""
from __future__ import annotations

from moecc.paradigms.step_guard import GPU, SPLIT, StepGuard


def summary(guard: StepGuard) -> dict[int, str]:
    """Batch size bucket (tokens, a power of two) -> the mode chosen, or ``"trying"``."""
    return {bucket: state.chosen or "trying" for bucket, state in sorted(guard.buckets.items())}


def _run(guard: StepGuard, step_s: dict[str, float], steps: int, tokens: int = 2048, start: float = 0.0):
    """``steps`` training steps of ``tokens`` whose length is ``step_s[mode]``; returns (modes, end clock)."""
    clock, modes = start, []
    for _ in range(steps):
        mode = guard.step_begins(tokens, clock, training=True)
        modes.append(mode)
        clock += step_s[mode]
    return modes, clock


def _guard(**options) -> StepGuard:
    return StepGuard(lambda begin, end: end - begin, **options)


def test_both_modes_are_tried_then_the_faster_is_kept():
    guard = _guard(trials=2)
    modes, _ = _run(guard, {SPLIT: 2.0, GPU: 1.5}, 12)
    # the first step is not timed; then alternating until each mode has two timed steps; then the GPU alone
    assert modes[:5] == [SPLIT, SPLIT, GPU, SPLIT, GPU]
    assert set(modes[6:]) == {GPU} and summary(guard) == {2048: GPU}
    guard = _guard(trials=2)
    modes, _ = _run(guard, {SPLIT: 1.5, GPU: 2.0}, 12)
    assert set(modes[6:]) == {SPLIT} and summary(guard) == {2048: SPLIT}


def test_the_gpu_alone_must_beat_the_splits_by_the_margin():
    guard = _guard(trials=1, margin=0.05)
    modes, _ = _run(guard, {SPLIT: 2.0, GPU: 1.95}, 8)  # 2.5% faster: within the noise
    assert summary(guard) == {2048: SPLIT} and modes[-1] == SPLIT


def test_batch_sizes_are_timed_apart_and_an_evaluation_leaves_a_step_untimed():
    guard = _guard(trials=1)
    seconds = {SPLIT: 1.0, GPU: 2.0}
    _run(guard, seconds, 6, tokens=512)
    assert summary(guard) == {512: SPLIT}
    modes, clock = _run(guard, {SPLIT: 3.0, GPU: 1.0}, 6, tokens=8000, start=100.0)
    assert summary(guard) == {512: SPLIT, 8192: GPU} and modes[-1] == GPU
    # an evaluation pass in between: the step before it is not timed, and it runs the chosen mode
    guard.step_begins(8000, clock, training=True)
    timed = sum(len(s) for s in guard.buckets[8192].seconds.values())
    assert guard.step_begins(8000, clock + 50.0, training=False) == GPU
    guard.step_begins(8000, clock + 51.0, training=True)
    assert sum(len(s) for s in guard.buckets[8192].seconds.values()) == timed


def test_marks_are_read_only_once_the_device_passed_them():
    done = set()
    guard = StepGuard(lambda begin, end: end - begin, done=lambda mark: mark in done, trials=1)
    for clock in (0.0, 1.0, 2.0, 4.0):  # split (untimed), split, gpu, then the splits while the reads wait
        guard.step_begins(1024, clock, training=True)
    assert summary(guard) == {1024: "trying"} and len(guard._pending) == 2
    done.update({2.0, 4.0})
    assert guard.step_begins(1024, 5.0, training=True) == SPLIT  # split 1 s, GPU 2 s
    assert summary(guard) == {1024: SPLIT}


def test_both_modes_are_tried_again_after_a_while():
    guard = _guard(trials=1, retry_after=5)
    modes, clock = _run(guard, {SPLIT: 1.0, GPU: 2.0}, 7)
    assert summary(guard) == {2048: SPLIT} and modes[-3:] == [SPLIT] * 3
    modes, _ = _run(guard, {SPLIT: 3.0, GPU: 1.0}, 12, start=clock)  # the machine got busier on the CPU side
    assert GPU in modes and modes[-1] == GPU and summary(guard) == {2048: GPU}


def test_an_evaluation_during_the_trials_leaves_that_mode_owed_and_a_choice_still_comes():
    guard = _guard(trials=1)
    clock = 0.0
    for mode_s in (2.0, 2.0):  # split (untimed), split (timed once the next training pass begins)
        guard.step_begins(2048, clock, training=True)
        clock += mode_s
    assert guard.step_begins(2048, clock, training=True) == GPU  # the GPU's trial
    clock += 1.0
    assert guard.step_begins(2048, clock, training=False) == SPLIT  # an evaluation inside it: untimed
    clock += 5.0
    modes, _ = _run(guard, {SPLIT: 2.0, GPU: 1.0}, 4, start=clock)
    assert modes[0] == GPU  # tried again
    assert summary(guard) == {2048: GPU} and modes[-1] == GPU


def test_batch_sizes_that_alternate_between_buckets_are_each_timed():
    guard = _guard(trials=1)
    clock, seconds = 0.0, {SPLIT: 2.0, GPU: 1.0}
    for step in range(16):  # dynamic padding around a power of two: each step's size differs from the last's
        tokens = 1000 if step % 2 else 2048
        clock += seconds[guard.step_begins(tokens, clock, training=True)]
    assert summary(guard) == {1024: GPU, 2048: GPU}
