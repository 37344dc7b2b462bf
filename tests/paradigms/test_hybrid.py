"""The hybrid paradigm against HF + PEFT with the split forced every way (all CPU, all GPU, alternating, random
per layer and pass, experts with no tokens on either side), and its own split, metrics and state."""
from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
import torch

import moecc
import moecc.paradigms.cpu_part as cpu_part_module
import moecc.paradigms.hybrid as hybrid_module
from moecc.errors import MoeccError
from moecc.paradigms.split_policy import FixedSplit, PlannedSplit

from ..parity import (assert_as_accurate, assert_as_accurate_as_recorded, assert_grads_as_accurate, batches,
                      build_pair, build_reference, float64_twin, forward_backward_exact, lora_config, record,
                      sgd_steps_recorded, train_as_accurately)


def _all_cpu(layer, counts, phase):
    return ()


def _all_gpu(layer, counts, phase):
    return range(len(counts))  # every expert, routed or not: the unrouted ones have no tokens on the GPU


def _alternating(layer, counts, phase):
    return range(layer % 2, len(counts), 2)


def _random(seed):
    rng = random.Random(seed)
    return lambda layer, counts, phase: [e for e in range(len(counts)) if rng.random() < 0.5]


def _unrouted_on_gpu(layer, counts, phase):
    """Every unrouted expert on the GPU, every routed one on the CPU: both sides hold experts with no tokens."""
    return [e for e, n in enumerate(counts) if n == 0]


def _moved_in_backward(layer, counts, phase):
    """Alternating in forward; in backward also every other CPU expert, whose backward then runs on the GPU from
    its forward recomputed there (the CPU keeps the rest of its saved state)."""
    gpu = set(range(layer % 2, len(counts), 2))
    return gpu | set(range((layer + 1) % 2, len(counts), 4)) if phase == "backward" else gpu


def _force(hybrid, rule, learning: bool = False) -> None:
    """Runs ``rule``'s splits on ``hybrid`` (an engine) from now on; None keeps its own policy. ``learning``: a
    planner beside the rule learns from every sample (its trackers fitted as the engine's own would be)."""
    if rule is not None:
        hybrid.use_split_policy(_RuleThatLearns(rule) if learning else FixedSplit(rule))


class _RuleThatLearns:
    """A rule's splits, while a planner (no step guard) is told everything the engine measures."""

    name = "fixed"

    def __init__(self, rule) -> None:
        self.fixed, self.planned = FixedSplit(rule), PlannedSplit(guard=None)

    def __getattr__(self, name):  # start, observations, counters, trackers: the planner's
        return getattr(self.planned, name)

    def pass_begins(self, tokens, training):
        self.planned.pass_begins(tokens, training)
        return False

    def forward(self, *args):
        return self.fixed.forward(*args)

    def backward(self, *args):
        return self.fixed.backward(*args)

    def prefetch(self, index, resident):
        return None


def _waits_for(monkeypatch, hybrid, phase: str) -> None:
    """Every CPU part of ``phase`` of ``hybrid`` lands in host memory, its caller waiting (none on the device)."""
    may_land = hybrid.cpu_part.may_land_on_device
    monkeypatch.setattr(hybrid.cpu_part, "may_land_on_device",
                        lambda weights, factors, passes, backward: (backward != (phase == "backward")
                                                                    and may_land(weights, factors, passes, backward)))


def _spy_landings(monkeypatch, hybrid, phase: str, calls: list, dtypes: set | None = None) -> None:
    """Appends to ``calls`` the layer of each CPU part of ``phase`` that lands on the device, and to ``dtypes``
    the dtypes of the views it lands in (forward: rows, tokens, weights; backward: the input gradient's rows)."""
    submit = getattr(hybrid.cpu_part, phase)

    def spied(index, *args):
        landing = submit(index, *args)
        if landing.on_device:
            calls.append(index)
            if dtypes is not None:
                views = landing.views
                dtypes.add(tuple(v.dtype for v in views.values()) if phase == "forward"
                           else views[landing.bank + "grad_hidden"].dtype)
        return landing
    monkeypatch.setattr(hybrid.cpu_part, phase, spied)


RULES = {"all_cpu": _all_cpu, "all_gpu": _all_gpu, "alternating": _alternating, "random": _random(3),
         "unrouted_on_gpu": _unrouted_on_gpu, "moved_in_backward": _moved_in_backward}


def _sgd(*models: torch.nn.Module) -> list[torch.optim.SGD]:
    return [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in models]


def _step(optimizers: list[torch.optim.SGD]) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _two_batches():
    return batches(256, 2, batch=3, seq=10, seed=7, pad=True)


@functools.cache
def _hf_peft_two_steps(family: str) -> list[tuple[dict, dict]]:
    """HF + PEFT's and the float64 run's records of two SGD steps from build_pair's start for ``family``
    (parity.sgd_steps_recorded): no split changes them, so they are run once for all the splits."""
    return sgd_steps_recorded(build_reference(family, torch.float32, lora_config(family)), _two_batches(), lr=0.05)


def train_two_steps_like_hf_peft(family: str, engine) -> None:
    """Two SGD steps of ``engine`` (fresh from build_pair for ``family``): logits, loss and every trainable
    gradient as accurate as HF + PEFT's at each, against the same steps in float64 (parity.train_as_accurately)."""
    train_as_accurately(engine, _sgd(engine)[0], _two_batches(), _hf_peft_two_steps(family))


def _four_layer_batches():
    return batches(256, 6, batch=2, seq=12, seed=4)


@functools.cache
def _hf_peft_aligned_steps() -> list[tuple[dict, dict, dict, dict]]:
    """Six SGD steps of HF + PEFT from build_pair's start (qwen3_moe, four layers), and at each one the same step
    in float64 from HF + PEFT's parameters: (HF + PEFT's record, the float64 run's (parity.record), HF + PEFT's
    and the float64 run's trainable parameters after the step). Run once for the tests that train aligned."""
    reference = build_reference("qwen3_moe", torch.float32, lora_config("qwen3_moe"), num_hidden_layers=4)
    exact = float64_twin(reference)
    optimizers, steps = _sgd(reference, exact), []
    for ids, mask, labels in _four_layer_batches():
        outs = [model(input_ids=ids, attention_mask=mask, labels=labels) for model in (reference, exact)]
        for out in outs:
            out.loss.backward()
        records = [record(model, out) for model, out in zip((reference, exact), outs)]
        _step(optimizers)
        trained = [{n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                   for model in (reference, exact)]
        steps.append((*records, *trained))
        with torch.no_grad():
            for (_, want), (_, truth) in zip(reference.named_parameters(), exact.named_parameters()):
                truth.copy_(want)
    return steps


def _aligned_step_like_hf_peft(engine, optimizers: list, step: int) -> None:
    """Step ``step`` (from 0) of ``engine`` (four-layer qwen3_moe from build_pair, trained by ``optimizers``), from
    HF + PEFT's parameters after the steps before: logits, loss and gradients as accurate as HF + PEFT's, and so
    the parameters after the SGD step, against the same step in float64 from the same point
    (parity.assert_as_accurate); then the engine's parameters are set to HF + PEFT's, so the next step too starts
    from the same point and is held to the one-step bound. Left to drift, the rounding of each step grows through
    the later steps (to 1.7e-4 by the third step of the three-slot test on an Intel Xeon with AMX, 6e-7 per step
    when aligned) and spreads the runs apart, so later steps could only be held to the wider bound for trained
    results (factors a step did not reach give errors of 0.1 to 1)."""
    ids, mask, labels = _four_layer_batches()[step]
    hf, exact, hf_trained, exact_trained = _hf_peft_aligned_steps()[step]
    out = engine(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert_as_accurate_as_recorded(engine, out, hf, exact)
    _step(optimizers)
    with torch.no_grad():
        for name, param in engine.named_parameters():
            if param.requires_grad:
                assert_as_accurate(param, hf_trained[name], exact_trained[name], name)
                param.copy_(hf_trained[name])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("rule", list(RULES))
def test_hybrid_trains_like_hf_peft_whatever_the_split(family, rule):
    """Two training steps: logits and every trainable gradient (attention LoRA through the routing weights'
    gradient, every expert LoRA factor) match HF + PEFT, however the experts are split."""
    _, engine = build_pair(family, torch.float32, lora_config(family), paradigm="hybrid")
    _force(engine.moecc.engine, RULES[rule])
    train_two_steps_like_hf_peft(family, engine)
    metrics = engine.moecc.engine.metrics_since_reset()
    if rule == "all_cpu":
        assert metrics["gpu_pairs"] == 0 and metrics["cpu_pairs"] > 0
    if rule in ("all_gpu", "unrouted_on_gpu"):
        assert metrics["gpu_pairs"] == (metrics["cpu_pairs"] + metrics["gpu_pairs"]) * (rule == "all_gpu")
    if rule in ("alternating", "random", "moved_in_backward"):
        assert metrics["gpu_pairs"] > 0 and metrics["cpu_pairs"] > 0 and metrics["both_sides_share"] > 0
    if rule != "random":  # random draws the backward's GPU set anew, moving some experts or none
        assert (metrics["moved_experts"] > 0) == (rule == "moved_in_backward")


def test_hybrid_own_split_matches_hf_peft_in_bf16_with_native_kernels():
    """The default engine (its own split, native kernels on the CPU side) in bf16, held to float32 HF + PEFT like
    the other paradigms' bf16 tests."""
    from .test_offload import _assert_bf16_as_accurate_as_hf_peft

    reference, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                                   backend="auto")
    _assert_bf16_as_accurate_as_hf_peft(reference, engine)


def test_native_cpu_part_keeps_its_other_experts_when_some_backward_moves_to_the_gpu(monkeypatch):
    """With the native kernels on the CPU side, a backward that moves some of the forward's CPU experts to the GPU
    (their saved rows dropped from the CPU's state, their forward recomputed on the GPU) is as accurate in bf16
    as HF + PEFT, like the engine that moves none; the GPU runs one backward per layer call, over its own experts
    and the moved ones together."""
    from .test_offload import _assert_bf16_as_accurate_as_hf_peft

    reference, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                                   backend="auto")
    _force(engine.moecc.engine, _moved_in_backward)
    calls = _count_device_backwards(monkeypatch, engine.moecc.engine)
    _assert_bf16_as_accurate_as_hf_peft(reference, engine)
    assert engine.moecc.engine.metrics_since_reset()["moved_experts"] > 0
    assert calls and calls == [1] * len(calls), calls


def _count_device_backwards(monkeypatch, hybrid) -> list[int]:
    """The device backend's backward calls within each of ``hybrid``'s layer backward calls, one entry per call."""
    from moecc.experts import select

    calls = []
    for name, math in list(select.DEVICE_BACKENDS.items()):
        def backward(*args, math=math):
            calls[-1] += 1
            return math.backward(*args)
        counted = type("Counted", (), {"forward": staticmethod(math.forward), "backward": staticmethod(backward)})
        monkeypatch.setitem(select.DEVICE_BACKENDS, name, counted)
    for layer in hybrid.layers:
        checked = layer.checked_backward
        monkeypatch.setattr(layer, "checked_backward",
                            lambda grad, backward, checked=checked: (calls.append(0), checked(grad, backward))[1])
    return calls


def test_cpu_lora_gradients_given_back_to_the_native_pool_change_no_gradient():
    """Hybrid gives the CPU part's LoRA gradients back to the native backend once summed, so each layer's CPU
    backward writes into the pages of the layer before's; every gradient equals, bit for bit, an engine's whose
    backend keeps them (never reusing one)."""
    engines = [build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                          backend="auto")[1] for _ in range(2)]
    natives = [getattr(engine.moecc.engine.cpu_part.backend, "native", engine.moecc.engine.cpu_part.backend) for engine in engines]
    lent, take = set(), natives[0]._results.take
    natives[0]._results.take = lambda shape, dtype: _noted(take(shape, dtype), lent)
    release = natives[1].release_result
    natives[1].release_result = lambda tensor: tensor.dtype == torch.float32 or release(tensor)
    for engine in engines:
        _force(engine.moecc.engine, _alternating)
        for ids, mask, labels in batches(256, 2, batch=3, seq=16, seed=4, pad=True):
            engine(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    given_back = [b for b in natives[0]._results._free if b.dtype == torch.float32]
    assert len(given_back) == 4 and len(lent) == 4  # one set of LoRA gradient buffers, reused by every layer
    for (name, p), (_, q) in zip(*(engine.named_parameters() for engine in engines)):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


def _noted(tensor: torch.Tensor, lent: set) -> torch.Tensor:
    if tensor.dtype == torch.float32:  # the results pool's only float32 tensors: LoRA gradients
        lent.add(tensor.data_ptr())
    return tensor


def test_split_follows_the_forecast_and_prefetches_the_next_layer():
    """After a first pass the forward prefetch plans each later layer from the forecast; a second forward finds
    the planned experts in the slots and the metrics count both sides."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    hybrid = engine.moecc.engine
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine(input_ids=ids, labels=ids).loss.backward()
    assert hybrid.split.forecast.expected(1) is not None
    assert set(hybrid.planned) >= {1}
    metrics = hybrid.metrics_since_reset()
    assert metrics["cpu_pairs"] + metrics["gpu_pairs"] == 3 * 2 * 16 * 2 * len(hybrid.layers)  # T*k per layer
    assert 0.0 <= metrics["prefetch_hit_rate"] <= 1.0


@pytest.mark.parametrize("probe", [True, False])
def test_a_cost_fit_that_priced_the_cpu_out_gets_it_back_after_a_step(probe):
    """A CPU fit whose fixed part prices the CPU out of every split runs each layer wholly on the GPU; after a
    step's worth of layer passes without a CPU part the fit starts over and the next step has CPU parts again.
    Without probes (``probe_after=0``) the CPU stays out for good: nothing in a pass without it corrects the fit."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           num_hidden_layers=4)  # more layers than slots: what a slot held is copied again
    hybrid = engine.moecc.engine
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        hybrid.reset_metrics()
        engine(input_ids=ids, labels=ids).loss.backward()
        return hybrid.metrics_since_reset()["cpu_experts"]

    for tracker in hybrid.split.trackers.values():  # copies dearer than any CPU part here: the CPU takes experts
        tracker.base = replace(tracker.base, copy_expert_s=1.0)
        tracker.probe_after = len(hybrid.layers) if probe else 0
    assert step() > 0 and step() > 0
    for tracker in hybrid.split.trackers.values():
        tracker.cpu_fixed_s = 100.0  # what a fit that learnt a slow CPU part holds
    assert step() == 0
    later = [step() for _ in range(2)]
    assert (later[0] > 0) == probe and (later[1] > 0) == probe


@pytest.mark.parametrize("faster", ["gpu", "split"])
def test_the_step_guard_keeps_whichever_mode_ran_the_faster_steps(faster):
    """With a step guard (on a CUDA GPU by default) whole steps run with the splits and with every expert on the
    GPU; from the step after both were timed, the faster one runs: no CPU part at all where the GPU alone was
    faster. Whatever ran, every step trains like HF + PEFT."""
    from moecc.paradigms.step_guard import StepGuard

    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           num_hidden_layers=4)
    hybrid = engine.moecc.engine
    for tracker in hybrid.split.trackers.values():  # copies dearer than any CPU part here: the splits use the CPU
        tracker.base = replace(tracker.base, copy_expert_s=1.0)
    assert hybrid.split.guard is None  # the CPU device: no link to save time on
    step_s = {"gpu": 1.0 if faster == "gpu" else 2.0, "split": 1.5}
    mode_at = {}
    guard = hybrid.split.guard = StepGuard(lambda begin, end: step_s[mode_at[begin]], trials=1)
    begins = guard.step_begins
    guard.step_begins = lambda tokens, mark, training: mode_at.setdefault(mark, begins(tokens, mark, training))
    optimizers = _sgd(engine)
    cpu_pairs = []
    for step in range(6):
        hybrid.reset_metrics()
        _aligned_step_like_hf_peft(engine, optimizers, step)
        metrics = hybrid.metrics_since_reset()
        cpu_pairs.append((metrics["cpu_pairs"], metrics["gpu_only_steps"]))
    # steps 1 and 2 split (the first untimed), 3 on the GPU alone; from step 4 the faster
    assert cpu_pairs[0][0] > 0 and cpu_pairs[1][0] > 0 and cpu_pairs[2] == (0, 1)
    if faster == "gpu":
        assert all(pairs == (0, 1) for pairs in cpu_pairs[3:]) and guard.buckets[32].chosen == "gpu"
    else:
        assert all(pairs > 0 and steps == 0 for pairs, steps in cpu_pairs[3:]) and guard.buckets[32].chosen == "split"


def test_the_step_guard_times_training_forwards_without_gradients_under_reentrant_checkpointing():
    """Reentrant checkpointing runs a training step's first forward without gradients: the model's training mode
    still makes it a training pass for the guard; an evaluation (eval mode, no gradients) is not one."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    hybrid = engine.moecc.engine
    seen = []

    class Recording:
        def step_begins(self, tokens, mark, training):
            seen.append(training)
            return "split"

    hybrid.split.guard = Recording()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.train()
    with torch.no_grad():
        engine(input_ids=ids)
    engine.eval()
    with torch.no_grad():
        engine(input_ids=ids)
    engine(input_ids=ids)  # gradients on in eval mode: a training pass all the same
    assert seen == [True, False, True]


def test_gaps_between_layers_are_measured_per_pass():
    """The work between one layer's experts and the next's (attention, router) is measured in both passes once a
    later pass begins; with reentrant checkpointing the backward's gaps hold recomputed layers (CPU parts and all),
    which no split changes, so they are not taken."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    hybrid = engine.moecc.engine
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine(input_ids=ids, labels=ids).loss.backward()
    engine(input_ids=ids)  # the third pass begins: the second's gaps are read
    for phase in ("forward", "backward"):
        assert hybrid.split.trackers[phase].serial_s is not None and hybrid.split.trackers[phase].serial_s > 0, phase

    reference, checkpointed = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    checkpointed.train()
    inner = checkpointed.moecc.engine
    _force(inner, _alternating, learning=True)
    for _ in range(2):
        checkpointed(input_ids=ids, labels=ids).loss.backward()
    checkpointed(input_ids=ids)
    assert inner.split.trackers["forward"].serial_s is not None and inner.split.trackers["backward"].serial_s is None


def _recording_model():
    """A four-layer hybrid model whose trackers record the gaps they are given, and a batch of 32 tokens."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           num_hidden_layers=4)
    hybrid = engine.moecc.engine
    return engine, hybrid, _recording_gaps(hybrid), torch.randint(0, 256, (2, 16),
                                                                  generator=torch.Generator().manual_seed(1))


def _recording_gaps(hybrid) -> dict[str, list]:
    """phase -> [(gaps, size)] of every ``observe_serial`` call from now on."""
    calls = {phase: [] for phase in hybrid.split.trackers}
    for phase, tracker in hybrid.split.trackers.items():
        observe = tracker.observe_serial
        tracker.observe_serial = lambda gaps, size, phase=phase, observe=observe: (
            calls[phase].append((list(gaps), size)), observe(gaps, size))
    return calls


def test_each_pass_gives_its_trackers_every_gap_at_once():
    """The serial estimate follows a pass's median gap, so each pass's gaps between consecutive layers go to its
    phase's tracker in one call, for its batch size: one fewer than the layers, forward and backward alike. A batch
    size's first pass (buffers growing, kernels loading) gives none; a size met again gives them."""
    engine, hybrid, calls, ids = _recording_model()
    longer = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    for batch in (ids, ids, longer, longer, ids, ids):  # each pass's gaps are read as the next one begins
        engine(input_ids=batch, labels=batch).loss.backward()
    for phase in ("forward", "backward"):
        assert [len(gaps) for gaps, _ in calls[phase]] == [3, 3, 3], phase  # the second, fourth and fifth passes
        assert [size for _, size in calls[phase]] == [32, 128, 32]  # each with its own size's estimate
        assert all(g >= 0 for gaps, _ in calls[phase] for g in gaps)
        assert set(hybrid.split.trackers[phase].serial_by_size) == {32, 128}
        # the pass running now (32 tokens) plans with its size's estimate, not the one measured last (128)
        assert hybrid.split.costs(phase).serial_s == hybrid.split.trackers[phase].serial_by_size[32]


def test_a_backwards_gaps_are_its_own_forward_passs_when_another_pass_runs_in_between():
    """A reference model's forward between a policy's forward and its backward (DPO), or a second micro-batch's
    forward before both backwards: each backward's gaps are its own forward pass's, dropped with that pass when it
    was its size's first, and never mixed with another pass's in one median."""
    engine, hybrid, calls, ids = _recording_model()
    engine.train()
    policy = engine(input_ids=ids, labels=ids).loss  # pass 1: the size's first training pass
    with torch.no_grad():
        engine(input_ids=ids)  # pass 2: a train-mode forward without gradients (DPO's reference)
    policy.backward()  # pass 1's backward: dropped with it
    first = engine(input_ids=ids, labels=ids).loss  # pass 3
    second = engine(input_ids=ids, labels=ids).loss  # pass 4
    (first + second).backward()  # both backwards, one after the other
    engine(input_ids=ids)  # pass 5 begins: everything before it has been read
    assert len(calls["forward"]) == 3  # passes 2, 3 and 4
    assert [len(gaps) for gaps, _ in calls["backward"]] == [3, 3]  # passes 3 and 4, each on its own


def test_a_sizes_first_backward_gives_no_gaps_after_a_forward_without_gradients():
    """Each phase's first pass with gaps at a size is dropped on its own: a train-mode forward without gradients
    (a reference model's, a log-probability pass) warms the forward at that size, not the backward."""
    engine, hybrid, calls, ids = _recording_model()
    engine.train()
    with torch.no_grad():
        engine(input_ids=ids)  # pass 1: the forward's first at this size
    engine(input_ids=ids, labels=ids).loss.backward()  # pass 2: its backward is the backward's first
    engine(input_ids=ids, labels=ids).loss.backward()  # pass 3
    engine(input_ids=ids)  # pass 4 begins
    assert len(calls["forward"]) == 2 and len(calls["backward"]) == 1  # passes 2 and 3; pass 3


def test_a_recomputed_layers_backward_is_filed_under_no_pass():
    """A recomputed call is numbered when the backward recomputes it, after any pass that began since its own
    forward: its backward's gaps are not filed under that pass."""
    engine, hybrid, calls, ids = _recording_model()
    engine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    engine.train()
    gaps = []
    gap = hybrid.split.gap
    hybrid.split.gap = lambda phase, index, forward_pass, ends: (gaps.append((phase, forward_pass, ends)),
                                                                 gap(phase, index, forward_pass, ends))
    engine(input_ids=ids, labels=ids).loss.backward()
    backward = {forward_pass for phase, forward_pass, ends in gaps if phase == "backward" and ends}
    assert backward == {None}  # every layer's backward is a recomputed call's under reentrant checkpointing


def test_passes_with_every_expert_on_the_gpu_give_no_gaps():
    """A step the guard runs with every expert on the GPU measures the GPU's share of the gap alone: it would wear
    down the splits' estimate, so its gaps are not taken."""
    engine, hybrid, calls, ids = _recording_model()
    modes = iter(["split", "split", "gpu", "split", "split"])

    class Scripted:
        def step_begins(self, tokens, mark, training):
            return next(modes)

    hybrid.split.guard = Scripted()
    for _ in range(5):
        engine(input_ids=ids, labels=ids).loss.backward()
    # pass 1 is its size's first, pass 3 ran on the GPU alone, pass 5's gaps are read when a sixth begins
    assert len(calls["forward"]) == 2 and len(calls["backward"]) == 2


def test_cpu_part_marks_give_each_part_in_order_and_the_chain_between_layers():
    """With ``cpu_marks`` set, each CPU part is marked submitted, started, computed and done in that order, and
    the timeline's ``chain`` reads one part per layer and pass from them."""
    import importlib.util
    from pathlib import Path

    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    hybrid = engine.moecc.engine
    _force(hybrid, _all_cpu)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    hybrid.cpu_part.marks = []
    engine(input_ids=ids, labels=ids).loss.backward()
    marks, hybrid.cpu_part.marks = hybrid.cpu_part.marks, None
    layers = len(hybrid.layers)
    for phase in ("forward", "backward"):
        for index in range(layers):
            names = [name for p, i, name, _ in sorted(marks, key=lambda m: m[3]) if (p, i) == (phase, index)]
            assert names == ["submitted", "started", "computed", "done"], (phase, index, names)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_timeline.py"
    spec = importlib.util.spec_from_file_location("hybrid_timeline", script)
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    lane = timeline.cpu_lane(marks)
    assert len(lane) == 2 * layers and all(start <= end for start, end in lane)
    found = timeline.chain(marks)
    for phase in ("forward", "backward"):
        assert found[phase]["parts"] == layers
        assert found[phase]["cycle_ms"] >= found[phase]["compute_ms"] > 0
        assert found[phase]["chain_gap_ms"] >= found[phase]["host_gap_ms"]


def test_slot_leftovers_of_an_earlier_pass_cost_no_copy():
    """What a layer's slot still holds from the last backward was copied in an earlier pass: the forward split
    takes it as resident, and only this pass's copies are charged."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    hybrid = engine.moecc.engine
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    engine(input_ids=ids, labels=ids).loss.backward()
    hybrid.pass_begins(32)  # a new pass: nothing copied in it yet
    layer = hybrid.layers[0]
    held = hybrid.slots.present(layer)
    assert held  # the backward left layer 0's experts in its slot
    seen = {}
    import moecc.paradigms.split_policy as split_policy_module

    original = split_policy_module.plan_split

    def spy(counts, costs, resident=(), committed=(), then=None, **options):
        seen.update(resident=set(resident), committed=set(committed))
        return original(counts, costs, resident, committed, then, **options)

    split_policy_module.plan_split = spy
    try:
        hybrid.forward_split(layer, [1] * layer.weights.num_experts)
    finally:
        split_policy_module.plan_split = original
    assert seen["committed"] == set() and seen["resident"] == held


def test_bad_expert_ids_are_refused_before_any_state_changes():
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    layer = engine.moecc.layers[0]
    hidden = torch.randn(3, layer.weights.hidden_size)
    weights = torch.full((3, 2), 0.5)
    passes = layer.engine.forward_passes
    for bad in (-1, layer.weights.num_experts):
        with pytest.raises(MoeccError, match=r"expert ids outside \[0, 8\)"):
            layer.submit(hidden, torch.tensor([[0, 1], [2, bad], [3, 4]]), weights)
    assert layer.engine.forward_passes == passes and not layer.engine.slots.held
    exact = float64_twin(reference)
    forward_backward_exact(reference, engine, exact, batches(256, 1, seed=2)[0])
    assert_grads_as_accurate(reference, engine, exact)



@pytest.mark.parametrize("rule", ["own", "all_gpu"])
def test_a_layer_call_with_no_tokens_has_zero_gradients(rule):
    """Zero tokens route nothing to either side; backward returns zeros of each input's shape (it failed to
    unpack the missing parts' gradients)."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    _force(engine.moecc.engine, None if rule == "own" else RULES[rule])
    layer = engine.moecc.layers[0]
    hidden = torch.randn(0, layer.weights.hidden_size, requires_grad=True)
    weights = torch.rand(0, 2, requires_grad=True)
    out = layer.submit(hidden, torch.zeros(0, 2, dtype=torch.long), weights).result()
    out.sum().backward()
    assert hidden.grad.shape == hidden.shape and weights.grad.shape == weights.shape
    expert_lora = [p for n, p in engine.named_parameters() if ".experts." in n and "lora_" in n]
    assert expert_lora and all(p.grad is not None and not p.grad.any() for p in expert_lora[:4])


def test_gpu_budget_counts_the_two_slots_hybrid_keeps_with_offload_slots_1():
    """Hybrid keeps at least two slots (one layer ahead); the budget check counts what it allocates."""
    from moecc.paradigms.device_slots import offload_gpu_bytes

    config = moecc.MoeccConfig(backend="reference", offload_slots=1)
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           moecc_options={"offload_slots": 1})
    hybrid = engine.moecc.engine
    assert hybrid.slots.capacity == 2
    two = offload_gpu_bytes(hybrid.layers, moecc.MoeccConfig(offload_slots=2), hybrid.slots.lora_on_device)
    assert hybrid.gpu_bytes(config) == two > offload_gpu_bytes(hybrid.layers, config, hybrid.slots.lora_on_device)

def test_hybrid_is_registered_and_reports_its_sides():
    assert "hybrid" in moecc.paradigms.PARADIGMS
    _, engine = build_pair("olmoe", torch.float32, lora_config("olmoe"), paradigm="hybrid")
    _force(engine.moecc.engine, _alternating)
    engine.moecc.engine.reset_metrics()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    engine(input_ids=ids, labels=ids).loss.backward()
    metrics = engine.moecc.engine.metrics_since_reset()
    for key in ("cpu_experts_s", "cpu_experts", "gpu_experts", "cpu_pairs", "gpu_pairs", "copy_s", "host_copy_in_gb",
                "cpu_wait_s", "both_sides_share", "tokens"):
        assert key in metrics, key
    assert metrics["tokens"] == 8 and metrics["cpu_experts_s"] > 0
    counters = engine.moecc.engine.counters_since_reset()  # the wait is the sum of what it waited for
    assert counters["gpu_wait_s"] == pytest.approx(counters["copy_wait_s"] + counters["device_cpu_wait_s"]
                                                   + counters["cpu_wait_s"])
    assert counters["cpu_wait_s"] > 0 and counters["device_cpu_wait_s"] == 0  # no device: the host waits
    assert engine.moecc.expert_bytes > 0


def test_cpu_parts_during_which_the_backend_buffers_grew_are_counted_not_fitted():
    """A cold CPU part (the backend's pools grew: page faults of first touch) stays out of the cost fit, where it
    priced the CPU out of the next splits; the parts after it are fitted."""
    from moecc.paradigms.hybrid_split import CostTracker, SideCosts

    _, model = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid")
    engine = model.moecc.engine
    base = SideCosts(cpu_expert_s=0.005, cpu_token_s=0.0, copy_expert_s=1e-3, gpu_expert_s=0.0, gpu_token_s=0.0)
    engine.split.trackers = {phase: CostTracker(base) for phase in ("forward", "backward")}
    engine.cpu_part._seen.add(("forward", 0))  # not the layer's first part
    engine.reset_metrics()
    engine.cpu_part.record("forward", 0, [3, 2], 0.050, 0, cold=True)
    assert engine.split.trackers["forward"].samples == 0 and engine.counters_since_reset()["cold_cpu_parts"] == 1
    engine.cpu_part.record("forward", 0, [3, 2], 0.004, 0, cold=False)
    assert engine.split.trackers["forward"].samples == 1 and engine.counters_since_reset()["cold_cpu_parts"] == 1


def test_a_repeated_step_grows_no_buffers_and_fits_every_later_part():
    """With the native kernels, the first step's CPU parts grow the backend's pools (cold); the same step again
    finds every buffer it needs, so none of its parts is cold and each one is fitted."""
    from moecc.experts.native import NativeExperts

    _, model = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                          backend="native")
    engine = model.moecc.engine
    assert isinstance(engine.cpu_part.backend, NativeExperts)
    _force(engine, _alternating, learning=True)
    ids, mask, labels = next(iter(batches(64, 1, seed=5)))
    counts = []
    for _ in range(3):
        engine.reset_metrics()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.zero_grad()
        counts.append((engine.counters_since_reset()["cold_cpu_parts"],
                       sum(t.samples for t in engine.split.trackers.values())))
    assert counts[0][0] > 0 and counts[2][0] == 0
    # every part of the last step was fitted: a forward and a backward one per layer split (both_sides counts forwards)
    assert counts[2][1] - counts[1][1] == 2 * engine.sides.both_sides > 0


@pytest.mark.gpu
@pytest.mark.parametrize("rule, slots", [("own", 2), ("own", 3), ("all_cpu", 2), ("all_gpu", 2), ("alternating", 2),
                                         ("random", 3), ("moved_in_backward", 2)])
def test_hybrid_on_cuda_matches_hf_peft(rule, slots):
    """On a GPU: pinned experts and LoRA, copies on the copy stream (one layer ahead, or two with three slots),
    the CPU part on the worker, both summed on the device; logits and gradients against HF + PEFT in float32
    (TF32 off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                                   device="cuda", moecc_options={"offload_slots": slots}, num_hidden_layers=4)
    _force(engine.moecc.engine, None if rule == "own" else RULES[rule])
    exact = float64_twin(reference)  # on the CPU
    expert_lora = [p for n, p in engine.named_parameters() if ".experts." in n and "lora_" in n]
    for batch in batches(256, 2, batch=3, seq=10, seed=5, pad=True):
        forward_backward_exact(reference, engine, exact, batch, device="cuda")
        assert_grads_as_accurate(reference, engine, exact)
        assert all(p.is_cuda and p.grad is not None and p.grad.is_cuda for p in expert_lora)
        for model in (reference, engine, exact):
            model.zero_grad()
    assert all(p.is_pinned() for layer in engine.moecc.layers for p in layer.experts.parameters(recurse=False))
    assert expert_lora and engine.moecc.engine.slots.lora_on_device  # tiny factors fit: stepped on the GPU


def test_auto_paradigm_says_what_it_picked(caplog):
    import logging

    from moecc.tiny_models import tiny_model

    with caplog.at_level(logging.INFO, logger="moecc"):
        model = moecc.prepare(tiny_model("qwen3_moe"), paradigm="auto", device="cpu")
    assert model.moecc.paradigm == "cocompute"
    assert "paradigm='auto' chose 'cocompute': no CUDA device" in caplog.text
    assert moecc.paradigms.choose_paradigm("auto", torch.device("cuda", 0)) == "offload"
    assert moecc.paradigms.choose_paradigm("offload", torch.device("cpu")) == "offload"


@pytest.mark.parametrize("cpu_per_token, want", [(3e-6, "hybrid"), (3e-4, "offload")])
def test_auto_paradigm_on_a_gpu_takes_the_planners_choice_from_the_cached_rates(cpu_per_token, want, tmp_path,
                                                                               monkeypatch, caplog):
    """With rates of the model's shape cached on this machine, ``"auto"`` on a CUDA device takes the paradigm the
    planner predicts fastest (hybrid where the CPU is fast enough to take a share, offload where it is not) and
    says so in one line with the predicted seconds; with none cached, or another model's, offload."""
    import json
    import logging

    from moecc.bench import rates_cache as rates_module
    from moecc.bench.presets import preset_config

    from ..bench.test_plan import qwen3_rates

    cache = tmp_path / "rates.json"
    monkeypatch.setattr(rates_module, "CACHE", cache)
    config = preset_config("qwen3-30b-a3b", 48)
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="moecc"):
        assert moecc.paradigms.choose_paradigm("auto", cuda, config) == "offload"  # nothing cached
    assert "no rates of this model's shape" in caplog.text
    cache.write_text(json.dumps({"version": rates_module.VERSION, **qwen3_rates(cpu_per_token=cpu_per_token)}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moecc"):
        assert moecc.paradigms.choose_paradigm("auto", cuda, config) == want
    line, = [r.getMessage() for r in caplog.records]
    assert f"chose '{want}': predicted seconds per step at 512 / 2048 / 8192 tokens" in line
    assert "qwen3-30b-a3b's shape, 48 layers" in line and "hybrid " in line and "cocompute " in line
    assert moecc.paradigms.choose_paradigm("auto", cuda, preset_config("tiny")) == "offload"  # not timed here
    cache.write_text(json.dumps({"version": rates_module.VERSION - 1, **qwen3_rates(cpu_per_token=cpu_per_token)}))
    assert moecc.paradigms.choose_paradigm("auto", cuda, config) == "offload"  # another version's rates


@pytest.mark.gpu
def test_summing_the_cpu_part_never_waits_for_the_device(monkeypatch):
    """The CPU part's gradients (dense or rows, and each LoRA factor's blocks) are read in place from staging
    buffers of their own: summing them queues device work and never blocks the host on it (a buffer shared by
    the four LoRA factors made the host wait for the device three times a layer)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moecc.experts import ExpertLora, LoraGrads
    from moecc.paradigms.part_sums import add_grads as _add
    from moecc.paradigms.part_sums import host_sources as _cpu_sources
    from moecc.staging import StagingBuffers

    device = torch.device("cuda", torch.cuda.current_device())
    experts, rank, hidden, inter, tokens, top_k = 8, 2, 16, 6, 5, 2
    lora = tuple(ExpertLora(torch.randn(rank * experts, n_in, device=device),
                            torch.randn(n_out, rank * experts, device=device), 0.5, experts)
                 for n_in, n_out in ((hidden, 2 * inter), (inter, hidden)))
    host = LoraGrads(*(torch.randn(t.shape) for part in lora for t in (part.A, part.B)))
    cpu = (torch.randn(7, hidden), torch.randn(tokens, top_k), host)
    rows_at = torch.tensor([0, 1, 1, 2, 3, 4, 4])
    like = torch.zeros(tokens, hidden, device=device)
    staging = StagingBuffers(device)
    sources = _cpu_sources(cpu[0], rows_at, cpu[1], host, (1, 5), lora)
    waits = []
    synchronize = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: (waits.append(event), synchronize(event)))
    torch.cuda._sleep(200_000_000)  # the device busy for a while: a wait would be one on it
    grad_hidden, grad_weights, grads = _add(staging, None, sources, "", lora, like, cpu[1].shape)
    assert waits == []
    torch.cuda.synchronize()
    assert torch.allclose(grad_hidden.cpu(), torch.zeros(tokens, hidden).index_add_(0, rows_at, cpu[0]))
    assert torch.equal(grad_weights.cpu(), cpu[1])
    want_a = torch.zeros_like(host.gate_up_A).view(experts, rank, -1)
    want_a[[1, 5]] = host.gate_up_A.view(experts, rank, -1)[[1, 5]]
    assert torch.equal(grads.gate_up_A.cpu(), want_a.view_as(host.gate_up_A))


@pytest.mark.parametrize("rule", ["alternating", "random"])
def test_cpu_parts_that_publish_their_rows_give_the_same_bits_as_waiting_for_them(rule, monkeypatch):
    """A forward's CPU part writes its rows into staging views and publishes them (``CpuDone``), the device
    summing them when they are published while the host goes on (the caller joins the part at the next layer
    call); every logit and gradient equals, bit for bit, an engine whose caller waits for each part."""
    def train(published: bool):
        _, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                               backend="auto", num_hidden_layers=4)
        if not published:
            _waits_for(monkeypatch, engine.moecc.engine, "forward")
        _force(engine.moecc.engine, _random(3) if rule == "random" else RULES[rule])
        calls, dtypes = [], set()
        _spy_landings(monkeypatch, engine.moecc.engine, "forward", calls, dtypes)
        logits = []
        for ids, mask, labels in batches(256, 2, batch=3, seq=16, seed=4, pad=True):
            calls.append("step")
            out = engine(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            logits.append(out.logits.detach())
        monkeypatch.undo()
        grads = {n: p.grad.clone() for n, p in engine.named_parameters() if p.requires_grad}
        assert dtypes <= {(torch.bfloat16, torch.int64, torch.float32)}  # rows cross as bf16, weights apart
        return logits, grads, calls

    logits, grads, calls = train(published=True)
    want_logits, want_grads, none = train(published=False)  # waited for: float32 rows, weighted on the CPU
    assert none == ["step", "step"]
    # The first step's callers wait (its kernels load then); the last layer's caller always does (nothing joins it)
    second = calls.index("step", 1)
    assert calls[:second] == ["step"] and calls[second + 1:] and 3 not in calls
    for got, want in zip(logits, want_logits):
        assert torch.equal(got, want)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name


@pytest.mark.parametrize("rule, checkpointing", [("alternating", None), ("random", None),
                                                  ("alternating", True), ("random", False)])
def test_backward_cpu_parts_that_publish_give_the_same_bits_as_waiting_for_them(rule, checkpointing, monkeypatch):
    """A backward's CPU part writes its input-gradient rows, routing-weight gradient and LoRA blocks into staging
    views and publishes them, the next backward layer call or the pass's end joining it; with and without
    (reentrant or not) gradient checkpointing every gradient equals, bit for bit, a caller that waits."""
    def train(published: bool):
        _, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                               backend="auto", num_hidden_layers=4)
        if not published:
            _waits_for(monkeypatch, engine.moecc.engine, "backward")
        if checkpointing is not None:
            engine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
            engine.train()
        _force(engine.moecc.engine, _random(3) if rule == "random" else RULES[rule])
        calls, dtypes = [], set()
        _spy_landings(monkeypatch, engine.moecc.engine, "backward", calls, dtypes)
        grads = []
        for ids, mask, labels in batches(256, 3, batch=3, seq=16, seed=4, pad=True):
            calls.append("step")
            engine(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            grads.append({n: p.grad.clone() for n, p in engine.named_parameters() if p.requires_grad})
        monkeypatch.undo()
        assert not engine.moecc.engine.cpu_part._backward_parts  # every published part joined by its pass
        assert dtypes <= {torch.bfloat16}  # the input-gradient rows cross as bf16
        return grads, calls

    grads, calls = train(published=True)
    want_grads, none = train(published=False)
    assert none == ["step"] * 3
    second = calls.index("step", 1)
    assert calls[:second] == ["step"]  # the first step's backward waits (its kernels load then)
    assert 0 in calls[second:] and 3 in calls[second:]  # the last layer and layer 0 publish too
    for got, want in zip(grads, want_grads):
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]), name


def _fail_cpu_part(monkeypatch, hybrid, phase: str, failing: int, message: str) -> list[int]:
    """Makes layer ``failing``'s CPU part of ``phase`` (``"forward"`` or ``"backward"``) of ``hybrid`` (an engine)
    raise ``message`` in its backend; returns the layers whose CPU part of that phase ran, in order."""
    backend, ran = hybrid.cpu_part.backend, []
    owners = {id(layer.experts): layer.index for layer in hybrid.layers}

    def failing_call(name):
        call = getattr(backend, name)

        def fails(weights, *args, **kwargs):
            index = owners[id(weights.cache_owner)]
            ran.append(index)
            if index == failing:
                raise RuntimeError(message)
            return call(weights, *args, **kwargs)
        return fails

    for name in (f"{phase}_pairs", f"{phase}_pairs_into"):
        monkeypatch.setattr(backend, name, failing_call(name))
    return ran


@pytest.mark.parametrize("failing", [2, 0])
def test_a_published_backward_part_that_fails_raises_from_backward_and_leaves_the_model_usable(failing,
                                                                                              monkeypatch):
    """The backward's CPU part of layer 2 (joined by layer 1's backward call, before it starts its own part) or of
    layer 0 (joined at the end of the pass) raises after the device was told to go on: ``backward()`` raises that
    error, nothing waits for ever, and after ``zero_grad`` the next step equals a fresh model's."""
    batch = batches(256, 1, batch=3, seq=16, seed=4, pad=True)[0]
    failing_model, fresh = _publishing_model(), _publishing_model()
    hybrid = failing_model.moecc.engine
    ran = _fail_cpu_part(monkeypatch, hybrid, "backward", failing, f"injected CPU backward failure in layer {failing}")
    published = []
    _spy_landings(monkeypatch, hybrid, "backward", published)
    out = failing_model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    with pytest.raises(RuntimeError, match=f"injected CPU backward failure in layer {failing}"):
        out.loss.backward()
    monkeypatch.undo()
    assert failing in published and ran[-1] == failing  # no layer's CPU part ran after the failed one
    assert not failing_model.moecc.engine.cpu_part._backward_parts
    failing_model.zero_grad(set_to_none=True)
    _assert_next_step_bit_equal(failing_model, fresh, batch)


def test_a_backward_that_dies_after_publishing_leaves_no_error_for_the_next_step(monkeypatch):
    """Layer 2's published backward part fails and the pass dies in layer 2's attention backward before any
    later layer call or its end joins the part: that error ends the pass, the next step does not raise the
    part's, and it equals a fresh model's."""
    batch = batches(256, 1, batch=3, seq=16, seed=4, pad=True)[0]
    failing_model, fresh = _publishing_model(), _publishing_model()
    _fail_cpu_part(monkeypatch, failing_model.moecc.engine, "backward", 2, "injected CPU backward failure in layer 2")
    attention = [m for name, m in failing_model.named_modules() if name.endswith("layers.2.self_attn")][0]

    def attention_fails(module, grad_output):
        raise RuntimeError("injected attention backward failure")

    hook = attention.register_full_backward_pre_hook(attention_fails)  # before the forward, which sets it up
    out = failing_model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    with pytest.raises(RuntimeError, match="injected attention backward failure"):
        out.loss.backward()
    monkeypatch.undo()
    hook.remove()
    assert failing_model.moecc.engine.cpu_part._backward_parts  # layer 2's part, never joined by that pass
    failing_model.zero_grad(set_to_none=True)
    _assert_next_step_bit_equal(failing_model, fresh, batch)


def test_a_forward_on_another_thread_leaves_a_running_backward_its_part_error(monkeypatch):
    """Layer 2's published backward part fails while another thread runs a forward of the same model (from inside
    the backward, before any later layer call joins the part): that forward joins the part but leaves its error
    to the backward it belongs to, whose ``backward()`` raises it instead of returning partial gradients."""
    import threading

    batch = batches(256, 1, batch=3, seq=16, seed=4, pad=True)[0]
    model = _publishing_model()
    _fail_cpu_part(monkeypatch, model.moecc.engine, "backward", 2, "injected CPU backward failure in layer 2")
    attention = [m for name, m in model.named_modules() if name.endswith("layers.2.self_attn")][0]
    forwards = []

    def forward_elsewhere(module, grad_output):
        if not forwards:  # once: the forward below runs this module again
            def run():
                with torch.no_grad():
                    forwards.append(model(input_ids=batch[0], attention_mask=batch[1]).logits)
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()

    hook = attention.register_full_backward_pre_hook(forward_elsewhere)
    out = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    with pytest.raises(RuntimeError, match="injected CPU backward failure in layer 2"):
        out.loss.backward()
    hook.remove()
    assert len(forwards) == 1 and not model.moecc.engine.cpu_part._backward_parts


def test_a_pass_end_waits_for_another_threads_join_of_its_failed_part(monkeypatch):
    """A forward on another thread has taken a backward pass's failing part and still waits for it when that
    pass ends: the pass's join waits until the error is filed and raises it, instead of finding no part and
    returning partial gradients."""
    import threading
    import time

    engine = _publishing_model().moecc.engine
    tasks = {}  # thread -> the graph task it runs (none: -1, a forward)
    monkeypatch.setattr(cpu_part_module, "current_graph_task", lambda: tasks.get(threading.get_ident(), -1))

    def slow_failure():
        time.sleep(0.4)
        raise RuntimeError("injected slow CPU part failure")

    engine.cpu_part._backward_parts.append((7, engine.cpu_part.worker.submit(slow_failure)))
    forward_join = threading.Thread(target=engine.cpu_part.join_backward)
    forward_join.start()
    time.sleep(0.1)  # it holds the part now
    tasks[threading.get_ident()] = 7
    try:
        with pytest.raises(RuntimeError, match="injected slow CPU part failure"):
            engine.cpu_part.join_backward()  # as pass 7's end-of-pass callback
    finally:
        forward_join.join()
    assert not engine.cpu_part._backward_errors


def test_the_first_backward_never_publishes_even_after_an_evaluation_forward(monkeypatch):
    """A forward without gradients before the first training step makes that step's forward the second pass, but
    its backward is still the first one (backward-only kernels load then): it waits for its CPU parts, and the
    next step's backward publishes."""
    _, model = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                          backend="auto", num_hidden_layers=4)
    _force(model.moecc.engine, _alternating)
    calls = []
    _spy_landings(monkeypatch, model.moecc.engine, "backward", calls)
    data = batches(256, 3, batch=3, seq=16, seed=4, pad=True)
    with torch.no_grad():
        model(input_ids=data[0][0], attention_mask=data[0][1])
    for ids, mask, labels in data[1:]:
        calls.append("step")
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert calls[:2] == ["step", "step"] and len(calls) > 2


def _publishing_model() -> torch.nn.Module:
    """A 4-layer bf16 hybrid model under the alternating split, as after a first step (its parts publish)."""
    _, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                           backend="auto", num_hidden_layers=4)
    _force(engine.moecc.engine, _alternating)
    engine.moecc.engine.forward_passes = 1
    engine.moecc.engine.cpu_part.first_backward_pass = 0
    return engine


def _assert_next_step_bit_equal(model: torch.nn.Module, fresh: torch.nn.Module, batch: tuple) -> None:
    """One forward and backward of both on ``batch``: the same logits and gradients, bit for bit."""
    ids, mask, labels = batch
    got, want = (m(input_ids=ids, attention_mask=mask, labels=labels) for m in (model, fresh))
    got.loss.backward()
    want.loss.backward()
    assert torch.equal(got.logits, want.logits)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


def test_a_published_cpu_part_that_fails_stops_the_pass_and_leaves_the_model_usable(monkeypatch):
    """The CPU part of layer 1 raises after the device was told to go on: layer 2's call raises that error before
    it changes any state, no layer waits for ever, and the next step equals a fresh model's."""
    batch = batches(256, 1, batch=3, seq=16, seed=4, pad=True)[0]
    failing, fresh = _publishing_model(), _publishing_model()
    hybrid = failing.moecc.engine
    _fail_cpu_part(monkeypatch, hybrid, "forward", 1, "injected CPU part failure")
    published = []
    _spy_landings(monkeypatch, hybrid, "forward", published)
    joined = []
    join = hybrid.cpu_part.join_deferred
    monkeypatch.setattr(hybrid.cpu_part, "join_deferred",
                        lambda index, join_part: (joined.append(index), join(index, join_part)))
    with pytest.raises(RuntimeError, match="injected CPU part failure"):
        failing(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    monkeypatch.undo()
    assert 1 in published and joined[-1] == 2  # layer 1 published its (failed) part; layer 2's call raised it
    _assert_next_step_bit_equal(failing, fresh, batch)


def test_a_pass_that_dies_between_layers_leaves_its_published_part_behind_not_in_the_next_pass(monkeypatch):
    """Layer 1's published CPU part fails and the pass then dies in layer 2's attention, before any layer call
    joins the part: that error ends the pass, the next one does not raise the part's, and it equals a fresh
    model's."""
    batch = batches(256, 1, batch=3, seq=16, seed=4, pad=True)[0]
    failing, fresh = _publishing_model(), _publishing_model()

    def attention_fails(module, args, kwargs):
        raise RuntimeError("injected attention failure")

    attention = [m for name, m in failing.named_modules() if name.endswith("layers.2.self_attn")][0]
    hook = attention.register_forward_pre_hook(attention_fails, with_kwargs=True)
    _fail_cpu_part(monkeypatch, failing.moecc.engine, "forward", 1, "injected CPU part failure")
    with pytest.raises(RuntimeError, match="injected attention failure"):
        failing(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    monkeypatch.undo()
    hook.remove()
    assert failing.moecc.engine.cpu_part._deferred.parts  # layer 1's part, never joined by that pass
    _assert_next_step_bit_equal(failing, fresh, batch)


def test_layers_the_reference_computes_never_publish_and_train_as_without(monkeypatch):
    """float32 experts run on the reference backend under backend="auto", which returns dense outputs: their CPU
    parts never publish (the second step failed when they did) and every step matches a caller that waits."""
    calls = []

    def train(published: bool):
        _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                               backend="auto", num_hidden_layers=4)
        if not published:
            _waits_for(monkeypatch, engine.moecc.engine, "forward")
        else:
            _spy_landings(monkeypatch, engine.moecc.engine, "forward", calls)
        _force(engine.moecc.engine, RULES["alternating"])
        logits = []
        for ids, mask, labels in batches(256, 3, batch=3, seq=16, seed=4, pad=True):
            out = engine(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            logits.append(out.logits.detach())
        monkeypatch.undo()
        return logits, {n: p.grad.clone() for n, p in engine.named_parameters() if p.requires_grad}

    logits, grads = train(published=True)
    assert calls == []
    want_logits, want_grads = train(published=False)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert all(torch.equal(grads[n], want_grads[n]) for n in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["own", "alternating"])
def test_hybrid_on_cuda_with_device_waits_is_as_accurate_as_hf_peft_in_bf16(rule, request):
    """bf16 on a GPU with the native kernels: the forward's and backward's CPU parts publish their results and the
    stream waits for them itself (``device_wait_share``, ``backward_device_wait_share`` > 0 where a split has both
    sides), held to float32 HF + PEFT. Device waits
    need eager kernel loading: under lazy loading the test runs again in a child process that loads eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from .test_device_wait import rerun_under_eager_loading

    if rerun_under_eager_loading(request):
        return
    from .test_offload import _assert_bf16_as_accurate_as_hf_peft

    reference, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="hybrid",
                                   backend="auto", device="cuda", num_hidden_layers=4)
    inner = engine.moecc.engine
    _force(inner, None if rule == "own" else RULES[rule])
    inner.forward_passes = 1  # as after a first step, which loads every kernel: CPU parts publish
    inner.cpu_part.first_backward_pass = 0
    assert inner.cpu_part.done.on_device, inner.cpu_part.done.reason
    inner.reset_metrics()
    _assert_bf16_as_accurate_as_hf_peft(reference, engine, device="cuda")
    metrics = inner.metrics_since_reset()
    if rule == "alternating":
        assert metrics["device_wait_share"] > 0 and metrics["backward_device_wait_share"] > 0


def test_three_slots_copy_two_layers_ahead_in_both_passes_and_train_like_hf_peft():
    """With ``offload_slots=3`` every forward layer call queues the copies of the next two layers and every
    backward layer call those of the two before; the model still trains like HF + PEFT."""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="hybrid",
                           moecc_options={"offload_slots": 3}, num_hidden_layers=4)
    hybrid = engine.moecc.engine
    assert hybrid.prefetch_depth == 2
    forward_ahead, backward_fetches = [], []
    plan, fetch = hybrid.prefetch_forward, hybrid.fetch

    def spy_plan(index):
        forward_ahead.append(index)
        return plan(index)

    def spy_fetch(phase, layer, experts, lora=None):
        if phase == "backward":
            backward_fetches.append(layer.index)
        return fetch(phase, layer, experts, lora)

    hybrid.prefetch_forward, hybrid.fetch = spy_plan, spy_fetch
    optimizers = _sgd(engine)
    for step in range(3):
        forward_ahead.clear()
        backward_fetches.clear()
        _aligned_step_like_hf_peft(engine, optimizers, step)
    assert forward_ahead == [1, 2, 2, 3, 3, 4, 4, 5]  # layer i asks for i+1 and i+2 (past the last: nothing)
    # Backward, layer i: its own GPU experts, then those of layers i-1 and i-2 (layers whose forward had none
    # fetch nothing: a forward all on the CPU)
    on_gpu = {layer.index for layer in hybrid.layers if layer.last_gpu}
    expected = [j for i in range(3, -1, -1) for j in (i, i - 1, i - 2) if j >= 0 and j in on_gpu]
    assert on_gpu and backward_fetches == expected
