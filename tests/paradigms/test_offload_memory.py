"""What an offloaded layer keeps for backward, parked in host memory: exact byte counts, buffers reused across
steps, metrics, parity with HF + PEFT with parking on and off, and (GPU) device memory actually freed."""
from __future__ import annotations

import functools
import gc

import pytest
import torch

import moecc
from moecc.experts import grouped
from moecc.paradigms.parking import SAVED_TENSORS, ActivationParking, ParkedState
from moecc.experts import SavedState
from moecc.staging import HostBufferPool
from moecc.tiny_models import tiny_model

from ..parity import (
    assert_as_accurate_as_recorded,
    assert_grads_as_accurate,
    batches,
    build_pair,
    build_reference,
    float64_twin,
    lora_config,
    record,
)

FAMILY = "qwen3_moe"  # tiny: H = 64, I = 32, E = 8, k = 2, two MoE layers


def saved_bytes(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype) -> int:
    """The minimal saved state: hidden [T, H] and pre-activations [T*k, 2I] in the activation dtype, float32
    routing weights [T, k], int64 offsets [E+1] and order [T*k]."""
    pairs = tokens * top_k
    return (tokens * hidden + pairs * 2 * inter) * dtype.itemsize + pairs * 4 + (experts + 1) * 8 + pairs * 8


def _tiny_engine(dtype: torch.dtype = torch.float32, compute: str = "reference", **overrides):
    model = moecc.prepare(tiny_model(FAMILY, dtype=dtype, **overrides), lora_config=lora_config(FAMILY),
                          device="cpu", paradigm="offload")
    model.moecc.engine.slots.compute = compute
    return model


def _layer_call(layer, tokens: int, dtype: torch.dtype, grad: bool = True):
    g = torch.Generator().manual_seed(tokens)
    weights = layer.weights
    hidden = torch.randn(tokens, weights.hidden_size, generator=g).to(dtype).requires_grad_(grad)
    index = torch.stack([torch.randperm(weights.num_experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).requires_grad_(grad)
    return layer.submit(hidden, index, weights).result()


def _state_bytes(state: SavedState) -> int:
    return sum(getattr(state, name).nbytes for name in SAVED_TENSORS)


@pytest.mark.parametrize("compute", ["reference", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("park", [True, False], ids=["parked", "on-device"])
def test_node_keeps_exactly_the_minimal_state(park, dtype, compute):
    if compute == "grouped" and not grouped.available(dtype, "cpu"):
        pytest.skip(f"this PyTorch build has no CPU torch._grouped_mm for {dtype}")
    model = _tiny_engine(dtype, compute)
    engine, layer = model.moecc.engine, model.moecc.layers[0]
    engine.slots.park_activations = park
    weights, tokens = layer.weights, 13
    expected = saved_bytes(tokens, weights.hidden_size, weights.intermediate_size, weights.num_experts, 2, dtype)
    node = _layer_call(layer, tokens, dtype).grad_fn
    held = [value for value in vars(node).values() if isinstance(value, torch.Tensor)]
    assert held == []  # besides the state, the node holds no tensor (its LoRA factors are the parameters)
    if park:
        state = node.state
        assert isinstance(state, ParkedState) and state.nbytes == expected and state.device is None
        buffer = state.buffer
        for view in state.views:  # all in the pooled buffer
            assert buffer.data_ptr() <= view.data_ptr() <= buffer.data_ptr() + buffer.numel() - view.nbytes
        assert engine.slots.parking.bytes_to_host == expected
    else:
        assert isinstance(node.state, SavedState) and _state_bytes(node.state) == expected
        assert engine.slots.parking.bytes_to_host == 0
    engine.slots.park_activations = True
    with torch.no_grad():
        _layer_call(layer, tokens, dtype, grad=False)  # nothing kept, nothing parked
    assert engine.slots.parking.bytes_to_host == (expected if park else 0)


def _train_step(model, ids, mask, labels) -> None:
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


def _parked_batches():
    return batches(256, 2, batch=3, seq=16, seed=5, pad=True)


@functools.cache
def _hf_peft_parked_passes() -> tuple[dict, dict]:
    """HF + PEFT's and the float64 run's records (parity.record) of the parking test's two passes from
    build_pair's start (qwen2_moe, three layers), the gradients accumulated: run once for both computes."""
    reference = build_reference("qwen2_moe", torch.float32, lora_config("qwen2_moe"), num_hidden_layers=3)
    models = (reference, float64_twin(reference))
    for batch in _parked_batches():
        for model in models:
            _train_step(model, *batch)
    return tuple(record(model) for model in models)


@pytest.mark.parametrize("compute", ["reference", "grouped"])
def test_parked_training_matches_hf_peft_and_unparked(compute):
    if compute == "grouped" and not grouped.available(torch.float32, "cpu"):
        pytest.skip("this PyTorch build has no CPU torch._grouped_mm for float32")
    _, engine = build_pair("qwen2_moe", torch.float32, lora_config("qwen2_moe"), paradigm="offload",
                           num_hidden_layers=3)
    engine.moecc.engine.slots.compute = compute
    engine.moecc.engine.slots.capacity = 2  # fewer slots than layers: weights and states prefetched together
    data = _parked_batches()
    for batch in data:  # two micro-batches accumulate
        _train_step(engine, *batch)
    assert engine.moecc.engine.counters_since_reset()["d2h_gb"] > 0
    assert_as_accurate_as_recorded(engine, None, *_hf_peft_parked_passes())
    parked = {n: p.grad.clone() for n, p in engine.named_parameters() if p.requires_grad}
    engine.zero_grad()
    engine.moecc.engine.slots.park_activations = False
    for batch in data:
        _train_step(engine, *batch)
    for name, param in engine.named_parameters():  # parking is a copy: bit-identical gradients
        if param.requires_grad:
            assert torch.equal(param.grad, parked[name]), name


def test_metrics_count_parked_and_restored_bytes():
    model = _tiny_engine()
    engine = model.moecc.engine
    (ids, mask, labels), = batches(256, 1, batch=2, seq=9, seed=1)
    weights = model.moecc.layers[0].weights
    per_layer = saved_bytes(ids.numel(), weights.hidden_size, weights.intermediate_size, weights.num_experts, 2,
                            torch.float32)
    runs = {}
    for park in (True, False):
        engine.slots.park_activations = park
        engine.slots.held.clear()  # the same weight copies in both runs
        engine.reset_metrics()
        _train_step(model, ids, mask, labels)
        runs[park] = engine.counters_since_reset()
    layers = len(model.moecc.layers)
    assert runs[True]["d2h_gb"] * 1e9 == pytest.approx(layers * per_layer, rel=1e-12)
    assert runs[False]["d2h_gb"] == 0
    # Restored bytes are host-to-device copies too, on top of the same expert weights.
    assert (runs[True]["h2d_gb"] - runs[False]["h2d_gb"]) * 1e9 == pytest.approx(layers * per_layer, rel=1e-9)
    assert runs[True]["d2h_s"] > 0 and runs[False]["d2h_s"] == 0


def test_host_buffers_are_reused_across_steps():
    model = _tiny_engine()
    engine = model.moecc.engine
    pool = engine.slots.parking.pool
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = batches(256, 4, batch=2, seq=16, seed=3)
    data[2] = tuple(t[:, :11] for t in data[2])  # a shorter batch fits the same buffers
    sizes = []
    for batch in data:
        _train_step(model, *batch)
        optimizer.step()
        optimizer.zero_grad()
        assert pool.free == pool.buffers  # every buffer is back once backward is done
        sizes.append((pool.allocations, pool.buffers, pool.nbytes))
    assert sizes[0][0] == len(model.moecc.layers)  # one buffer per layer, allocated in the first step only
    assert sizes == [sizes[0]] * len(sizes)
    outputs = model(input_ids=data[0][0])  # a graph freed without backward gives its buffers back
    assert pool.free == pool.buffers - len(model.moecc.layers)
    del outputs
    gc.collect()
    assert pool.free == pool.buffers and pool.allocations == sizes[0][0]


def test_pool_lends_the_smallest_fit_and_never_grows_past_the_peak():
    pool = HostBufferPool(pinned=False, min_bytes=64)
    a, _ = pool.acquire(100)
    b, _ = pool.acquire(1000)
    assert (a.numel(), b.numel()) == (128, 1024)
    pool.release(b)
    pool.release(a, "copy-event")
    again, event = pool.acquire(90)  # the smallest that fits, with the event its next writer waits for
    assert again.data_ptr() == a.data_ptr() and event == "copy-event"
    pool.release(again)
    bigger, event = pool.acquire(5000)  # nothing fits: the largest free buffer (1024) is dropped for it
    assert bigger.numel() == 8192 and event is None
    assert (pool.buffers, pool.free, pool.allocations, pool.nbytes) == (2, 1, 3, 128 + 8192)
    assert pool.acquire(1)[0].data_ptr() == a.data_ptr()


def test_parking_round_trip_keeps_values_and_layout():
    parking = ActivationParking(torch.device("cpu"), None)
    g = torch.Generator().manual_seed(0)
    saved = SavedState(torch.randn(5, 7, generator=g).to(torch.bfloat16), torch.rand(5, 3, generator=g),
                       torch.arange(4), torch.randperm(15, generator=g), torch.randn(15, 6, generator=g),
                       torch.float16)
    state = parking.park((1, 0), saved)
    for name, view in zip(SAVED_TENSORS, state.views):
        assert view.data_ptr() % 64 == 0 and view.data_ptr() != getattr(saved, name).data_ptr()
    parking.prefetch((1, 0))  # starts the restore, gives the buffer back
    assert parking.pool.free == 1 and state.buffer is None
    back, ready = parking.take(state)
    assert ready is None and back.weights_dtype == torch.float16
    for name in SAVED_TENSORS:
        assert torch.equal(getattr(back, name), getattr(saved, name)), name
        assert getattr(back, name).dtype == getattr(saved, name).dtype
    assert parking.bytes_to_host == parking.bytes_to_device == _state_bytes(saved)


def _cuda_pair():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    reference, engine = build_pair(FAMILY, torch.float32, lora_config(FAMILY), paradigm="offload", device="cuda",
                                   num_hidden_layers=6, max_position_embeddings=2048)
    engine.moecc.engine.slots.capacity = 2
    (ids, mask, labels), = batches(256, 1, batch=4, seq=1024, seed=7)
    return reference, engine, (ids, mask, labels)


@pytest.mark.gpu
def test_parking_on_cuda_matches_hf_peft():
    reference, engine, (ids, mask, labels) = _cuda_pair()
    exact = float64_twin(reference)  # on the CPU
    state = engine.moecc.engine
    assert state.slots.park_activations
    engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss.backward()
    for model in (reference, exact):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    # The reference runs on the CPU, the engine's attention on CUDA's float32 kernels, which sum in other orders:
    # each its own float32 rounding of the float64 result.
    assert_grads_as_accurate(reference, engine, exact)
    assert state.slots.parking.bytes_to_host > 0 and state.slots.parking.bytes_to_device == state.slots.parking.bytes_to_host
    buffer, _ = state.slots.parking.pool.acquire(1)
    assert buffer.is_pinned()
    state.slots.parking.pool.release(buffer)


@pytest.mark.gpu
@pytest.mark.xfail(reason="open bug: on the host (torch 2.11, CUDA) a parked forward held 14 MB more device memory "
                          "than an unparked one instead of 19 MB less; the CPU path frees the saved tensors (see "
                          "test_node_keeps_exactly_the_minimal_state)", strict=False)
def test_parking_on_cuda_frees_device_memory():
    _, engine, (ids, mask, labels) = _cuda_pair()
    state = engine.moecc.engine
    weights = engine.moecc.layers[0].weights
    per_layer = saved_bytes(ids.numel(), weights.hidden_size, weights.intermediate_size, weights.num_experts, 2,
                            torch.float32)
    after_forward = {}
    for park in (False, True, False, True):  # twice each: the first pass allocates what every pass reuses
        state.slots.park_activations = park
        engine.zero_grad()
        out = engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after_forward[park] = torch.cuda.memory_allocated()
        out.loss.backward()
        del out
    layers = len(engine.moecc.layers)
    assert after_forward[False] - after_forward[True] >= 0.95 * layers * per_layer, (after_forward, per_layer)


@pytest.mark.gpu
def test_cuda_park_and_restore_never_sync_and_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    parking = ActivationParking(device, torch.cuda.Stream(device))
    g = torch.Generator(device=device).manual_seed(0)

    def state():
        return SavedState(torch.randn(3000, 256, generator=g, device=device).to(torch.bfloat16),
                          torch.rand(3000, 8, generator=g, device=device),
                          torch.arange(129, device=device), torch.randperm(24000, generator=g, device=device),
                          torch.randn(24000, 96, generator=g, device=device).to(torch.bfloat16), torch.bfloat16)

    parking.take(parking.park((0, 0), state()))  # the pool's buffer is allocated (pinned) here
    expected = state()
    copies = {name: getattr(expected, name).clone() for name in SAVED_TENSORS}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        parked = parking.park((1, 0), expected)
        del expected  # freed while the copy may still run: record_stream keeps the memory from reuse
        torch.randn(3000, 256, device=device)  # work on the compute stream that could take that memory
        parking.prefetch((1, 0))
        back, ready = parking.take(parked)
        torch.cuda.current_stream().wait_event(ready)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in SAVED_TENSORS:
        assert torch.equal(getattr(back, name), copies[name]), name
    assert parking.pool.allocations == 1


def test_backward_restores_each_layer_one_layer_ahead(monkeypatch):
    """Backward of layer L queues its own state's copy back (if the layer after did not) and then layer L-1's,
    before it uses its own."""
    model = _tiny_engine(num_hidden_layers=4)
    parking = model.moecc.engine.slots.parking
    events, restore, take = [], ActivationParking.restore, ActivationParking.take

    def recording_restore(self, state):
        if state.buffer is not None:
            events.append(("restore", state.key[1]))
        restore(self, state)

    def recording_take(self, state):
        events.append(("take", state.key[1]))
        return take(self, state)

    monkeypatch.setattr(ActivationParking, "restore", recording_restore)
    monkeypatch.setattr(ActivationParking, "take", recording_take)
    (ids, mask, labels), = batches(256, 1, batch=2, seq=8, seed=2)
    _train_step(model, ids, mask, labels)
    assert events == [("restore", 3), ("restore", 2), ("take", 3), ("restore", 1), ("take", 2), ("restore", 0),
                      ("take", 1), ("take", 0)]
    assert parking.pool.free == parking.pool.buffers


def test_consecutive_experts_are_copied_in_one_run():
    from moecc.paradigms.device_slots import _runs

    cached = (torch.zeros(1), torch.zeros(1))
    sources = {e: None for e in range(10)} | {7: cached}
    assert _runs([5, 0, 1, 2, 7, 8], sources) == [(0, 3, None), (5, 6, None), (7, 8, cached), (8, 9, None)]
    assert _runs(list(range(10)), {e: None for e in range(10)}) == [(0, 10, None)]
    assert _runs([], sources) == []
