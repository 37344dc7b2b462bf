"""Metrics accumulators stay bounded over a run that never reads them, and sum what a plain list would."""
from __future__ import annotations

import torch

import moecc
from moecc.paradigms import event_spans
from moecc.paradigms.event_spans import EventSpans, RoutingSkew
from moecc.tiny_models import tiny_model

from ..parity import batches, lora_config


class FakeEvent:
    """A timing event at ``at`` ms that completes once ``done`` is set (as a CUDA event would)."""

    def __init__(self, at: float, done: bool = True) -> None:
        self.at, self.done, self.waited = at, done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at - self.at


def test_event_spans_fold_finished_pairs_and_keep_unfinished_ones(monkeypatch):
    monkeypatch.setattr(event_spans, "FOLD_AT", 4)
    spans = EventSpans()
    pending = FakeEvent(10.0, done=False)
    spans.add(FakeEvent(0.0), pending)  # 10 ms, not finished
    for i in range(10):
        pair = (FakeEvent(0.0), FakeEvent(2.0))  # 2 ms each, finished
        spans.add(*pair)
        assert spans.held() <= 5
        assert spans.last() == pair  # even once folded, while an older unfinished pair is still held
    assert spans.added == 11 and spans.last()[1].at == 2.0
    assert not pending.waited
    assert abs(spans.seconds() - 0.03) < 1e-12 and pending.waited  # 10 x 2 ms + 10 ms: nothing lost in the folds
    spans.reset()
    assert spans.seconds() == 0.0 and spans.added == 11 and spans.last() is None


def test_routing_skew_folds_lists_and_tensors_into_the_same_mean(monkeypatch):
    monkeypatch.setattr(event_spans, "FOLD_AT", 3)
    skew = RoutingSkew()
    calls = [[4, 0, 0, 0], torch.tensor([1, 1, 1, 1]), [0, 0, 0, 0], torch.tensor([2, 1, 1, 0])] * 5
    for counts in calls:
        skew.add(counts)
        assert skew.held() <= 4
    expected = [4.0, 1.0, 2.0] * 5  # max * E / sum, calls with no pair left out
    assert abs(skew.mean() - sum(expected) / len(expected)) < 1e-12
    assert skew.calls() == 15 and skew.pairs() == 5 * (4 + 4 + 0 + 4)


def test_a_loop_that_never_reads_its_metrics_keeps_them_bounded(monkeypatch):
    monkeypatch.setattr(event_spans, "FOLD_AT", 8)
    model = moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), lora_config=lora_config("qwen3_moe"),
                          device="cpu", paradigm="hybrid")
    (ids, mask, labels), = batches(256, 1, batch=2, seq=12, seed=1)
    engine = model.moecc.engine
    for _ in range(6):  # 2 layers a forward: 12 layer calls, folded past 8
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert engine.metrics.skew.held() <= 9
    assert engine.metrics.skew.calls() == 6 * len(model.moecc.layers)
    assert engine.metrics_since_reset()["routing_skew"] >= 1.0
