"""The cache of hot experts (offload and hybrid): served instead of PCIe copies, within its budget, never stale."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import moecc
from moecc.tiny_models import tiny_model

from ..parity import (assert_as_accurate, assert_as_accurate_as_recorded, assert_grads_as_accurate, batches,
                      float64_twin, lora_config, randomize_lora, record)


def _reference(base: torch.nn.Module, family: str = "qwen3_moe"):
    """HF + PEFT over ``base`` with the adapters of these tests."""
    from peft import get_peft_model

    reference = get_peft_model(base, lora_config(family))
    randomize_lora(reference, 3)
    return reference


def _pair(cache_gb: float, family: str = "qwen3_moe", paradigm: str = "offload"):
    base = tiny_model(family, dtype=torch.float32, seed=0)
    reference = _reference(copy.deepcopy(base), family)
    config = moecc.MoeccConfig(backend="reference", offload_cache_gb=cache_gb, offload_slots=1)
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config(family), device="cpu", paradigm=paradigm,
                           config=config)
    engine.load_state_dict(reference.state_dict())
    return reference, engine


def _cuda_pair(config: moecc.MoeccConfig):
    """HF + PEFT on the CPU, and the same model under offload on CUDA with ``config`` (skips without a GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=0)
    reference = _reference(copy.deepcopy(base))
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe"), device="cuda",
                           paradigm="offload", config=config)
    engine.load_state_dict(reference.state_dict())
    torch.backends.cuda.matmul.allow_tf32 = False
    return reference, engine


def _expert_bytes(engine) -> int:
    weights = engine.moecc.layers[0].weights
    return weights.gate_up[0].nbytes + weights.down[0].nbytes


def _three_pass_batch():
    return batches(256, 1, batch=2, seq=12, seed=5)[0]


@functools.cache
def _hf_peft_three_passes() -> tuple[dict, dict]:
    """HF + PEFT's and the float64 run's records (parity.record) of three training passes of one batch, the
    gradients accumulated: no cache setting or paradigm changes them, so they are run once."""
    reference = _reference(tiny_model("qwen3_moe", dtype=torch.float32, seed=0))
    exact = float64_twin(reference)
    ids, mask, labels = _three_pass_batch()
    records = []
    for model in (reference, exact):
        for _ in range(3):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
        records.append(record(model, out))
    return tuple(records)


def _three_passes_match_reference(engine) -> list[dict]:
    """Three training passes of one batch through ``engine`` (metrics of each, CUDA names): its logits and
    accumulated gradients as accurate as HF + PEFT's after as many passes (parity.assert_as_accurate_as_recorded,
    against the float64 run's)."""
    state = engine.moecc.engine
    ids, mask, labels = _three_pass_batch()
    runs = []
    for _ in range(3):
        state.reset_metrics()
        out = engine(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        runs.append(state.counters_since_reset())
    assert_as_accurate_as_recorded(engine, out, *_hf_peft_three_passes())
    return runs


def test_cache_serves_hot_experts_instead_of_copies_and_training_matches():
    _, engine = _pair(cache_gb=1.0)  # room for every expert of the tiny model
    runs = _three_passes_match_reference(engine)
    assert runs[-1]["cache_hits"] > 0 and runs[-1]["cache_gb"] > 0
    assert runs[-1]["h2d_gb"] < runs[0]["h2d_gb"]  # after the first pass the routed experts come from the cache


@pytest.mark.parametrize("paradigm", ["offload", "hybrid"])
def test_cache_stays_within_its_budget(paradigm):
    _, engine = _pair(cache_gb=0.0)
    budget = 3 * _expert_bytes(engine)  # three experts' worth
    _, engine = _pair(cache_gb=budget / 1e9, paradigm=paradigm)
    (ids, mask, _), = batches(256, 1, batch=2, seq=12, seed=5)
    for _ in range(2):
        with torch.no_grad():
            engine(input_ids=ids, attention_mask=mask)
    cache = engine.moecc.engine.slots.cache
    assert 0 < cache.bytes <= budget and len(cache.entries) == 3
    hottest = {key for key, _ in cache.counts.most_common(3)}
    assert set(cache.entries) == hottest


def test_hybrid_runs_cached_experts_on_the_gpu_where_copying_them_would_not_pay(monkeypatch):
    """Copies dearer than the CPU: the first pass runs every expert on the CPU; once the cache holds them (fed by
    hybrid's routing) the split takes them as resident and runs them on the GPU, served from the cache, and
    training still matches HF + PEFT."""
    from moecc.paradigms.hybrid_split import SideCosts

    _, engine = _pair(cache_gb=1.0, paradigm="hybrid")
    hybrid = engine.moecc.engine
    costs = SideCosts(cpu_expert_s=1e-3, cpu_token_s=1e-5, copy_expert_s=0.1, gpu_expert_s=1e-5, gpu_token_s=1e-8,
                      both_sides_s=0.0)
    monkeypatch.setattr(hybrid.split, "costs", lambda phase: costs)
    runs = _three_passes_match_reference(engine)
    assert runs[0]["gpu_experts"] == 0 and runs[0]["cpu_experts"] > 0
    for later in runs[1:]:
        assert later["cpu_experts"] == 0 and later["gpu_experts"] > 0
    assert runs[1]["cache_hits"] > 0  # the slots fill from the cache (later passes may find them still there)


def test_merge_makes_cached_copies_stale():
    reference, engine = _pair(cache_gb=1.0)
    exact = float64_twin(reference)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            engine(input_ids=ids)  # fill the cache
        for model in (reference, engine, exact):
            model.merge_adapter()
        assert_as_accurate(*(model(input_ids=ids).logits for model in (engine, reference, exact)), "merged")


def test_negative_cache_budget_is_refused():
    with pytest.raises(ValueError, match="offload_cache_gb"):
        moecc.MoeccConfig(offload_cache_gb=-1.0)


@pytest.mark.gpu
def test_cache_on_cuda_serves_copies_and_matches():
    reference, engine = _cuda_pair(moecc.MoeccConfig(offload_cache_gb=1.0, offload_slots=1))
    exact = float64_twin(reference)  # on the CPU
    (ids, mask, labels), = batches(256, 1, batch=2, seq=12, seed=5)
    state = engine.moecc.engine
    for _ in range(2):
        state.reset_metrics()
        with torch.no_grad():
            out = engine(input_ids=ids.cuda(), attention_mask=mask.cuda())
    assert state.metrics_since_reset()["cache_hits"] > 0
    with torch.no_grad():
        expected, want = (model(input_ids=ids, attention_mask=mask).logits for model in (reference, exact))
    assert_as_accurate(out.logits, expected, want, "logits")


def _fill(cache, layers, keys):
    for layer, expert in keys:
        counts = [0] * layers[layer].weights.num_experts
        counts[expert] = 100 - len(cache.counts)  # earlier keys hotter
        cache.observe(layer, counts)
    cache.refill(layers)


def test_shrinking_cache_frees_chunks_and_keeps_the_experts_of_the_rest(monkeypatch):
    from moecc.paradigms import expert_cache
    from moecc.paradigms.expert_cache import ExpertCache

    _, engine = _pair(cache_gb=0.0)
    layers = engine.moecc.layers
    slot = expert_cache._aligned(layers[0].weights.gate_up[0].nbytes) + expert_cache._aligned(
        layers[0].weights.down[0].nbytes)
    monkeypatch.setattr(expert_cache, "CHUNK_BYTES", 2 * slot)  # two slots a chunk
    cache = ExpertCache(torch.device("cpu"), 5 * slot)
    keys = [(layer, expert) for layer in range(len(layers)) for expert in range(3)][:5]
    _fill(cache, layers, keys)
    assert set(cache.entries) == set(keys) and cache.bytes == 5 * slot  # chunks of 2, 2 and a cut one of 1
    for (layer, expert), (gate_up, down, _) in cache.entries.items():
        assert torch.equal(gate_up, layers[layer].weights.gate_up[expert])
        assert torch.equal(down, layers[layer].weights.down[expert])
    kept_before = {key for key, slot_index in cache._slot_of.items() if slot_index < 2}
    cache.resize(3 * slot)  # two chunks would hold four: the second is freed, not kept past the budget
    assert cache.bytes == 2 * slot and set(cache.entries) == kept_before  # freed at once, the first chunk intact
    cache.refill(layers)
    assert cache.bytes == 3 * slot and set(cache.entries) == set(keys[:3])  # a second chunk cut to one slot
    cache.resize(6 * slot)
    cache.refill(layers)  # five experts counted: the cut chunk replaced by a full one, then one of one slot
    assert cache.bytes == 5 * slot and [c.nbytes for c in cache._chunks] == [2 * slot, 2 * slot, slot]
    assert set(cache.entries) == set(keys)
    for (layer, expert), (gate_up, down, _) in cache.entries.items():
        assert torch.equal(gate_up, layers[layer].weights.gate_up[expert])
        assert torch.equal(down, layers[layer].weights.down[expert])


class _FakePeak:
    """Stands in for the CUDA allocator's peak: the largest of what the test says each pass used, plus the cache
    held, since the last reset."""

    def __init__(self, engine) -> None:
        self.engine, self.most, self.resets = engine, 0, 0

    def used(self, nbytes: int) -> None:
        self.most = max(self.most, nbytes + self.engine.slots.cache.bytes)

    def peak(self) -> int:
        return self.most

    def reset(self) -> None:
        self.most, self.resets = 0, self.resets + 1


def _auto_cache_passes() -> list[tuple[tuple, bool]]:
    """(batch, whether it trains) of each pass of the auto-cache test."""
    small = batches(256, 1, batch=2, seq=12, seed=5)[0]  # 24 tokens: bucket 32
    large = batches(256, 1, batch=4, seq=12, seed=6)[0]  # 48 tokens: bucket 64
    return [(small, False)] + [(small, True)] * 3 + [(large, True)] * 2 + [(small, True)]


@functools.cache
def _hf_peft_auto_cache_passes() -> tuple[dict, dict]:
    """HF + PEFT's and the float64 run's records of the auto-cache test's passes, the gradients accumulated: run
    once for both paradigms."""
    reference = _reference(tiny_model("qwen3_moe", dtype=torch.float32, seed=0))
    exact = float64_twin(reference)
    for (ids, mask, labels), train in _auto_cache_passes():
        with torch.set_grad_enabled(train):
            for model in (reference, exact):
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                if train:
                    out.loss.backward()
    return record(reference), record(exact)


@pytest.mark.parametrize("paradigm", ["offload", "hybrid"])
def test_auto_cache_takes_what_each_batch_size_leaves(paradigm):
    """Under "auto" a batch size's first training pass runs without a cache, the next ones with the limit less the
    margin less that size's peak; a larger size that leaves less shrinks the cache before its passes; a forward
    without gradients first does not open it; training is still as accurate as HF + PEFT's."""
    _, engine = _pair(cache_gb="auto", paradigm=paradigm)
    state = engine.moecc.engine
    assert state.slots.cache is not None and state.slots.peak_memory is None  # the CPU device has no allocator peak
    state.slots.peak_memory = fake = _FakePeak(state)
    expert = _expert_bytes(engine)
    state.slots.cache_sizer.limit_bytes = limit = 100 * expert
    state.slots.cache_sizer.margin = 0.0
    held = []
    for ((ids, mask, labels), train), used in zip(_auto_cache_passes(), [20, 90, 90, 90, 97, 97, 90], strict=True):
        with torch.set_grad_enabled(train):
            out = engine(input_ids=ids, attention_mask=mask, labels=labels)
            if train:
                out.loss.backward()
        held.append(state.slots.cache.bytes)
        fake.used(used * expert)  # what this pass used besides the cache, read when the next pass begins
    assert held[0] == held[1] == 0  # an evaluation, then the size's first training pass: no cache
    assert 0 < held[2] <= limit - 90 * expert and held[3] == held[2]
    assert held[4] == 0  # the larger size's first pass: the cache made way
    assert 0 < held[5] <= limit - 97 * expert < held[2]
    assert held[6] == held[2]  # back to the small size: its budget again
    assert fake.resets == len(held)  # each pass's peak measured from its own start
    assert_as_accurate_as_recorded(engine, None, *_hf_peft_auto_cache_passes())


def test_auto_cache_is_accepted_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOECC_OFFLOAD_CACHE_GB", "Auto")
    assert moecc.MoeccConfig.from_env().offload_cache_gb == "auto"
    assert moecc.MoeccConfig(offload_cache_gb=" AUTO").offload_cache_gb == "auto"
    with pytest.raises(ValueError, match="a number of GB or 'auto', got 'most'"):
        moecc.MoeccConfig(offload_cache_gb="most")


@pytest.mark.gpu
def test_auto_cache_on_cuda_fills_what_the_budget_leaves_and_matches():
    reference, engine = _cuda_pair(moecc.MoeccConfig(offload_cache_gb="auto", gpu_memory_budget_gb=1.0,
                                                     offload_slots=1))
    exact = float64_twin(reference)  # on the CPU
    (ids, mask, labels), = batches(256, 1, batch=2, seq=12, seed=5)
    state = engine.moecc.engine
    held = []
    for _ in range(3):
        state.reset_metrics()
        out = engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
        out.loss.backward()
        held.append(state.slots.cache.bytes)
    sizer = state.slots.cache_sizer
    peak = sizer.peaks[32]  # 24 tokens: the pass's measured peak besides the cache (weights, slots, activations)
    assert held[0] == 0 and peak > 0 and 0 < held[1] <= 1e9 * (1 - sizer.margin) - peak
    assert state.metrics_since_reset()["cache_hits"] > 0
    a, c = (model(input_ids=ids, attention_mask=mask, labels=labels) for model in (reference, exact))
    for _ in range(2):
        for model in (reference, exact):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for output in (a, c):
        output.loss.backward()
    assert_as_accurate(out.logits, a.logits, c.logits, "logits")
    assert_grads_as_accurate(reference, engine, exact)
