"""The offload paradigm: copies only what is routed, reuses device slots, follows PEFT merges, GPU budget, HF
gradient checkpointing."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import moecc
from moecc.experts import grouped
from moecc.lora import lora_tensors
from moecc.paradigms.offload import OffloadEngine

from ..parity import (
    assert_as_accurate,
    assert_as_accurate_as_recorded,
    assert_grads_as_accurate,
    batches,
    build_pair,
    build_reference,
    float64_twin,
    forward_backward_exact,
    lora_config,
    randomize_lora,
    record,
    rel_err,
    sgd_steps_recorded,
    train_as_accurately,
)


def _expert_bytes(engine, experts: int) -> int:
    weights = engine.moecc.layers[0].weights
    return experts * (weights.gate_up[0].nbytes + weights.down[0].nbytes)


@pytest.mark.parametrize("lora_place", ["host", "device"])
def test_copies_only_routed_experts_and_reuses_slots(lora_place):
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="offload",
                           moecc_options={"offload_lora": lora_place})
    state = engine.moecc
    assert state.engine.slots.lora_on_device == (lora_place == "device")
    state.engine.reset_metrics()
    ids = torch.tensor([[5]])
    with torch.no_grad():
        engine(input_ids=ids)
    routed = sum(len(layer.last_experts) for layer in state.layers)
    assert routed == 2 * len(state.layers)  # one token, k = 2: two experts per layer, nothing else
    # host factors are staged once per forward pass; device factors are used in place
    lora_bytes = sum(t.nbytes for layer in state.layers for t in lora_tensors(layer.lora()) if t is not None)
    lora_bytes *= lora_place == "host"
    assert state.engine.counters_since_reset()["h2d_gb"] * 1e9 == pytest.approx(_expert_bytes(engine, routed)
                                                                               + lora_bytes)
    state.engine.reset_metrics()
    with torch.no_grad():
        engine(input_ids=ids)  # both layers' slots are still resident (2 slots, 2 layers): only LoRA is sent again
    assert state.engine.counters_since_reset()["h2d_gb"] * 1e9 == pytest.approx(lora_bytes)


def _fake_offload_model(lora_bytes: int, layer_bytes: int, rest_bytes: int):
    """A model of ``rest_bytes`` of non-expert weights and one offloaded layer (experts of ``layer_bytes``, expert
    LoRA factors of ``lora_bytes``), as the GPU budget estimate sees them."""
    from types import SimpleNamespace

    wrapper = torch.nn.Module()
    wrapper.lora_A = torch.nn.Parameter(torch.zeros(lora_bytes // 4))
    experts = SimpleNamespace(gate_up_proj=torch.zeros(layer_bytes // 4, dtype=torch.bfloat16),
                              down_proj=torch.zeros(layer_bytes // 4, dtype=torch.bfloat16))
    layer = SimpleNamespace(wrappers={"gate_up_proj": wrapper}, experts=experts)
    model = torch.nn.Module()
    model.attention = torch.nn.Parameter(torch.zeros(rest_bytes // 2, dtype=torch.bfloat16))
    return model, [layer]


def _fake_cuda_engine(layers: list) -> OffloadEngine:
    """An offload engine over ``layers`` that believes it runs on a GPU (built on the CPU, so none is needed)."""
    engine = OffloadEngine(torch.device("cpu"))
    engine.device = engine.slots.device = torch.device("cuda", 0)
    engine.layers.extend(layers)  # the list the slots hold too
    return engine


def test_offload_lora_placement_follows_the_budget(monkeypatch):
    """``auto`` keeps the expert LoRA state (4x the factors) on the GPU when it fits a quarter of the budget and
    everything else that stays there still fits beside it; otherwise the host, so no budget that fits with the
    factors in host memory is refused because of them."""
    from moecc import api
    from moecc.paradigms.device_slots import lora_on_device

    monkeypatch.setattr(api, "cap_gpu_memory", lambda *args: None)
    cuda = torch.device("cuda", 0)
    model, layers = _fake_offload_model(lora_bytes=1_000_000, layer_bytes=2_000_000, rest_bytes=1_000_000)
    # resident without the LoRA: 1 MB + 2 slots x 2 MB = 5 MB; the LoRA state: 4 MB, at most a quarter of 16 MB
    # but not of 15
    assert lora_on_device(model, layers, cuda, moecc.MoeccConfig(gpu_memory_budget_gb=0.016))
    assert not lora_on_device(model, layers, cuda, moecc.MoeccConfig(gpu_memory_budget_gb=0.015))
    # 4 MB is a quarter of 20 MB, but with a 10 MB cache the GPU would need (1 + 4 + 10 + 4) x 1.1 = 20.9 MB:
    # host, where (1 + 4 + 10) x 1.1 = 16.5 MB fits
    config = moecc.MoeccConfig(gpu_memory_budget_gb=0.020, offload_cache_gb=0.010)
    assert not lora_on_device(model, layers, cuda, config)
    engine = _fake_cuda_engine(layers)
    api.apply_gpu_budget(model, engine, config)
    engine.slots.lora_on_device = True  # forced on the GPU, the same budget is refused, saying what to do
    with pytest.raises(moecc.MoeccError, match="offload_lora='host'"):
        api.apply_gpu_budget(model, engine, config)
    tiny = moecc.MoeccConfig(gpu_memory_budget_gb=1e-6, offload_lora="device")
    assert lora_on_device(model, layers, cuda, tiny)
    assert not lora_on_device(model, layers, cuda, moecc.MoeccConfig(offload_lora="host"))
    assert lora_on_device(model, layers, torch.device("cpu"), moecc.MoeccConfig())
    with pytest.raises(ValueError, match="offload_lora"):
        moecc.MoeccConfig(offload_lora="gpu")
    monkeypatch.setenv("MOECC_OFFLOAD_LORA", "Host")
    assert moecc.MoeccConfig.from_env().offload_lora == "host"


def _three_batches():
    return batches(256, 3, batch=2, seq=12, seed=4)


@functools.cache
def _hf_peft_three_steps() -> list[tuple[dict, dict]]:
    """HF + PEFT's and the float64 run's records of three SGD steps from build_pair's start (qwen3_moe, three
    layers; parity.sgd_steps_recorded): run once for every slot count, optimizer and LoRA placement."""
    reference = build_reference("qwen3_moe", torch.float32, lora_config("qwen3_moe"), num_hidden_layers=3)
    return sgd_steps_recorded(reference, _three_batches(), lr=0.05)


@pytest.mark.parametrize("slots,fused,lora_place", [(2, False, "host"), (8, False, "host"), (8, True, "host"),
                                                     (2, True, "device")])
def test_optimizer_steps_reach_the_device_copies_of_the_lora_factors(slots, fused, lora_place):
    """The device copies of the expert LoRA factors are made again after each optimizer step (the slots keep the
    weights across steps), so every step's forward uses the updated factors, as HF + PEFT does: with slots
    reassigned between layers (2) or every layer's slot kept across steps (8), and with a fused optimizer, which
    writes the factors without bumping their version counters. Each step is as accurate as HF + PEFT's against
    the same training in float64 (parity.train_as_accurately). (Copies that are not refreshed give errors of
    0.1 to 1.)"""
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="offload",
                           moecc_options={"offload_lora": lora_place}, num_hidden_layers=3)
    engine.moecc.engine.slots.capacity = slots
    optimizer = torch.optim.SGD([p for p in engine.parameters() if p.requires_grad], lr=0.05, fused=fused)
    train_as_accurately(engine, optimizer, _three_batches(), _hf_peft_three_steps())


def _assert_logits_as_accurate(reference, engine, exact, ids, what: str) -> None:
    """The engine's logits for ``ids`` are as accurate as HF + PEFT's against the float64 ``exact``'s."""
    assert_as_accurate(engine(input_ids=ids).logits, reference(input_ids=ids).logits, exact(input_ids=ids).logits,
                       what)


def test_merge_adapter_refreshes_device_copies():
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="offload")
    exact = float64_twin(reference)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine(input_ids=ids)  # fill the slots
        for model in (reference, engine, exact):
            model.merge_adapter()
        _assert_logits_as_accurate(reference, engine, exact, ids, "merged")
        # unmerge, new LoRA values, merge again: the same merged-adapter list over other weights
        for model in (reference, engine, exact):
            model.unmerge_adapter()
        randomize_lora(reference, 9)
        engine.load_state_dict(reference.state_dict())
        exact.load_state_dict(reference.state_dict())
        for model in (reference, engine, exact):
            model.merge_adapter()
        _assert_logits_as_accurate(reference, engine, exact, ids, "merged again")


GROUPED = {"offload_compute": "grouped"}


def _force_grouped(monkeypatch, dtype: torch.dtype) -> list:
    """Counts torch._grouped_mm calls: returns a list that grows by one per call (select the grouped compute with
    ``GROUPED``)."""
    if not grouped.available(dtype, "cpu"):
        pytest.skip(f"this PyTorch build has no CPU torch._grouped_mm for {dtype}")
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_compute_trains_like_hf_peft(family, monkeypatch):
    """The grouped expert math (LoRA factorised, so not bit-exact) as accurate as HF + PEFT in float32."""
    calls = _force_grouped(monkeypatch, torch.float32)
    reference, engine = build_pair(family, torch.float32, lora_config(family), paradigm="offload",
                                   moecc_options=GROUPED)
    exact = float64_twin(reference)
    assert engine.moecc.engine.slots.compute == "grouped"
    batch, = batches(256, 1, batch=3, seq=16, seed=4, pad=True)
    forward_backward_exact(reference, engine, exact, batch)
    assert_grads_as_accurate(reference, engine, exact)
    assert calls, "the grouped path fell back to the per-expert loop"


def _assert_bf16_as_accurate_as_hf_peft(reference, engine, device: str = "cpu") -> None:
    """Through a whole bf16 model the rounding differences compound: HF + PEFT in bf16 is itself several
    percent from the same model in float32 on some gradients, and a second bf16 pipeline that rounds elsewhere
    lands a similar distance away in another direction. So the engine is held to the float32 model: no further
    from it than 1.5 times HF + PEFT's own bf16 distance, plus 1e-2. All three run on ``device``, so attention
    and the dense layers use the same kernels in each (GPU and CPU attention round differently)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference.to(device)
    exact = copy.deepcopy(reference).float()
    (ids, mask, labels), = batches(256, 1, batch=3, seq=16, seed=4, pad=True)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    hf, truth, mine = (model(input_ids=ids, attention_mask=mask, labels=labels) for model in (reference, exact, engine))
    for output in (hf, truth, mine):
        output.loss.backward()
    assert rel_err(mine.logits, truth.logits) <= 1.5 * rel_err(hf.logits, truth.logits) + 1e-2
    for (name, p), (_, q), (_, t) in zip(reference.named_parameters(), engine.named_parameters(),
                                         exact.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, t.grad) <= 1.5 * rel_err(p.grad, t.grad) + 1e-2, name


def test_grouped_compute_in_bf16_is_as_accurate_as_hf_peft(monkeypatch):
    calls = _force_grouped(monkeypatch, torch.bfloat16)
    reference, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="offload",
                                   moecc_options=GROUPED)
    _assert_bf16_as_accurate_as_hf_peft(reference, engine)
    assert calls


def test_compute_choice_defaults_and_validation(monkeypatch):
    monkeypatch.delenv("MOECC_OFFLOAD_COMPUTE", raising=False)
    cpu = torch.device("cpu")
    assert OffloadEngine.from_config(cpu, moecc.MoeccConfig.from_env()).slots.compute == "reference"  # exact on the CPU
    monkeypatch.setenv("MOECC_OFFLOAD_COMPUTE", "Grouped")
    assert OffloadEngine.from_config(cpu, moecc.MoeccConfig.from_env()).slots.compute == "grouped"
    monkeypatch.setenv("MOECC_OFFLOAD_COMPUTE", "fast")
    with pytest.raises(ValueError, match="offload_compute 'fast'.*grouped, reference"):
        moecc.MoeccConfig.from_env()
    engine = OffloadEngine(cpu, compute="reference")
    with pytest.raises(moecc.MoeccError, match="compute='loop'"):
        engine.slots.compute = "loop"


@pytest.mark.gpu
@pytest.mark.parametrize("lora_place", ["host", "device"])
def test_offload_on_cuda_matches_and_respects_budget(lora_place):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, engine = build_pair("deepseek_v3", torch.float32, lora_config("deepseek_v3"), paradigm="offload",
                                   device="cuda", moecc_options={"offload_lora": lora_place})
    exact = float64_twin(reference)  # on the CPU
    torch.backends.cuda.matmul.allow_tf32 = False
    (ids, mask, labels), = batches(256, 1, seed=3)
    a, c = (model(input_ids=ids, attention_mask=mask, labels=labels) for model in (reference, exact))
    b = engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
    assert_as_accurate(b.logits, a.logits, c.logits, "logits")
    b.loss.backward()
    assert all(p.is_pinned() for layer in engine.moecc.layers for p in layer.experts.parameters(recurse=False))
    expert_lora = [p for n, p in engine.named_parameters() if ".experts." in n and "lora_" in n]
    assert expert_lora
    if lora_place == "host":
        assert all(p.is_pinned() for p in expert_lora)  # copied every forward pass: pinned, async
    else:
        assert all(p.is_cuda and p.grad is not None and p.grad.is_cuda for p in expert_lora)
    for out in (a, c):
        out.loss.backward()
    assert_grads_as_accurate(reference, engine, exact)
    from moecc.tiny_models import tiny_model

    with pytest.raises(moecc.MoeccError, match="too small"):
        moecc.prepare(tiny_model("qwen3_moe"), paradigm="offload", device="cuda",
                      config=moecc.MoeccConfig(gpu_memory_budget_gb=1e-6))


@pytest.mark.gpu
def test_offload_on_cuda_bf16_defaults_to_grouped_math(monkeypatch):
    if not torch.cuda.is_available() or not grouped.available(torch.bfloat16, "cuda"):
        pytest.skip("needs a CUDA GPU on which torch._grouped_mm runs bf16 (compute capability 9.x or 10.x)")
    monkeypatch.delenv("MOECC_OFFLOAD_COMPUTE", raising=False)
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    reference, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), paradigm="offload",
                                   device="cuda")
    assert engine.moecc.engine.slots.compute == "grouped" and engine.moecc.engine.slots.park_activations
    _assert_bf16_as_accurate_as_hf_peft(reference, engine, device="cuda")
    assert calls
    assert engine.moecc.engine.counters_since_reset()["d2h_gb"] > 0  # the saved states went through host memory


def _copied_bytes(engine, model, data) -> tuple[int, int]:
    """(expert weight bytes, activation bytes parked) that training on ``data`` from empty slots copies."""
    state = engine.moecc.engine
    state.slots.held.clear()
    weights, parked = state.slots.h2d_bytes, state.slots.parking.bytes_to_host
    for ids, mask, labels in data:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return state.slots.h2d_bytes - weights, state.slots.parking.bytes_to_host - parked


def _checkpointed_batches():
    return batches(256, 2, batch=3, seq=16, seed=6, pad=True)  # two micro-batches accumulate


@functools.cache
def _exact_checkpointed_passes(family: str) -> dict:
    """The float64 run's record (parity.record) of the checkpointing test's two passes from build_pair's start
    (three layers), run once for both kinds of checkpointing (without any: the same function)."""
    reference = build_reference(family, torch.float32, lora_config(family), num_hidden_layers=3)
    exact = float64_twin(reference)
    for ids, mask, labels in _checkpointed_batches():
        exact(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return record(exact)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: shared experts after the routed ones
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_matches_hf_peft_without_extra_copies(family, reentrant):
    """HF gradient checkpointing recomputes each layer's forward inside backward: the offloaded experts must give
    HF + PEFT's gradients, copy no expert weights beyond an uncheckpointed run (no prefetch of the next layer
    from a recomputation) and park nothing a recomputation produces (its state is used at once)."""
    reference, engine = build_pair(family, torch.float32, lora_config(family), paradigm="offload",
                                   num_hidden_layers=3)
    engine.moecc.engine.slots.capacity = 2
    data = _checkpointed_batches()
    plain = _copied_bytes(engine, engine, data)
    engine.zero_grad()
    for model in (reference, engine):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for ids, mask, labels in data:
        reference(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    checkpointed = _copied_bytes(engine, engine, data)
    assert_as_accurate_as_recorded(engine, None, record(reference), _exact_checkpointed_passes(family))
    assert checkpointed[0] == plain[0]
    # Non-reentrant: forward runs with gradients and parks as usual. Reentrant: forward runs without gradients
    # (nothing to keep) and the recomputation inside backward keeps its state on the device.
    assert checkpointed[1] == (0 if reentrant else plain[1]) and plain[1] > 0


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gradient_checkpointing_on_cuda_matches_hf_peft():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    reference, engine = build_pair("qwen2_moe", torch.float32, lora_config("qwen2_moe"), paradigm="offload",
                                   device="cuda", num_hidden_layers=4)
    exact = float64_twin(reference)  # on the CPU, without checkpointing: the same function
    engine.moecc.engine.slots.capacity = 2
    for model in (reference, engine):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for ids, mask, labels in batches(256, 2, batch=4, seq=64, seed=8, pad=True):
        for model in (reference, exact):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss.backward()
    assert_grads_as_accurate(reference, engine, exact)
    assert engine.moecc.engine.counters_since_reset()["d2h_gb"] > 0


def test_large_batches_prefetch_whole_layers_and_read_routing_once_a_layer(monkeypatch):
    """The first layer's routing decides to prefetch the next layers whole; every layer reads its routing back to
    the host once (the expert-id check, which also gives the token counts for the metrics) and a layer whose slot
    holds every expert copies nothing more."""
    import moecc.paradigms.offload as offload

    reference, engine = build_pair("qwen2_moe", torch.float32, lora_config("qwen2_moe"), paradigm="offload",
                                   num_hidden_layers=3)
    exact = float64_twin(reference)
    calls, routed_counts = [], offload.routed_counts
    monkeypatch.setattr(offload, "routed_counts", lambda *a: calls.append(1) or routed_counts(*a))
    (ids, mask, labels), = batches(256, 1, batch=4, seq=16, seed=2)
    engine.moecc.engine.reset_metrics()
    out = engine(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(calls) == 3
    assert all(engine.moecc.engine.slots.holds_all(layer) for layer in engine.moecc.layers[1:])
    a, c = (model(input_ids=ids, attention_mask=mask, labels=labels) for model in (reference, exact))
    assert_as_accurate(out.logits, a.logits, c.logits, "logits")
    for output in (out, a, c):
        output.loss.backward()
    assert_grads_as_accurate(reference, engine, exact)
    metrics = engine.moecc.engine.metrics_since_reset()
    assert metrics["routing_skew"] >= 1.0  # counts from every layer, device-side ones included
    skew = engine.moecc.engine.metrics.skew
    assert skew.calls() == 3 and skew.pairs() == 3 * 4 * 16 * reference.config.num_experts_per_tok
