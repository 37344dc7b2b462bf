"""The co-compute layer on its own: empty batches, device moves, the overlap contract, checkpointing."""
from __future__ import annotations

import functools

import pytest
import torch

from ..parity import (assert_as_accurate, assert_as_accurate_as_recorded, batches, build_pair, build_reference,
                      float64_twin, lora_config, record)


def test_zero_tokens_forward_and_backward():
    _, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"))
    layer = engine.moecc.layers[0]
    hidden = torch.zeros(0, engine.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    index = torch.zeros(0, 2, dtype=torch.int64)
    weights = torch.zeros(0, 2, dtype=torch.bfloat16, requires_grad=True)
    out = layer.submit(hidden, index, weights).result()
    assert out.shape == (0, engine.config.hidden_size)
    out.sum().backward()
    assert hidden.grad.shape == hidden.shape


def test_submit_overlaps_caller_work_and_matches_reference():
    """Work queued between submit and result runs while the CPU experts compute; the result is unchanged."""
    reference, engine = build_pair("qwen2_moe", torch.float32, lora_config("qwen2_moe"))
    exact = float64_twin(reference)
    layer = engine.moecc.layers[0]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, engine.config.hidden_size, generator=generator)
    index = torch.randint(0, 8, (9, 2), generator=generator)
    weights = torch.rand(9, 2, generator=generator)
    pending = layer.submit(hidden, index, weights)
    busy = sum(torch.randn(64, 64).sum().item() for _ in range(20))  # caller-side work in the window
    out = pending.result()
    expected, want = ([m for n, m in model.named_modules() if n.endswith("layers.0.mlp")][0].experts(*inputs)
                      for model, inputs in ((reference, (hidden, index, weights)),
                                            (exact, (hidden.double(), index, weights.double()))))
    assert isinstance(busy, float)
    assert_as_accurate(out, expected, want, "experts")
    assert engine.moecc.engine.metrics.tokens_routed >= 18


def test_experts_module_survives_and_returns_from_device_moves():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    experts = engine.moecc.layers[0].experts
    wrapper = [m for n, m in engine.named_modules() if n.endswith("layers.0.mlp.experts")][0]
    assert wrapper.to("meta") is wrapper and wrapper.half() is wrapper
    assert experts.gate_up_proj.device.type == "cpu" and experts.gate_up_proj.dtype == torch.float32


class _CountingBackend:
    """The engine's expert backend, appending to ``calls`` once per forward."""

    def __init__(self, backend, calls: list) -> None:
        self.backend, self.calls = backend, calls

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args, **kwargs):
        self.calls.append(1)
        return self.backend.forward(*args, **kwargs)


def _count_forwards(engine) -> list:
    """A list that grows by one per CPU expert forward ``engine`` runs."""
    calls: list = []
    engine.backend = _CountingBackend(engine.backend, calls)
    return calls


@functools.cache
def _exact_pass(family: str) -> dict:
    """The float64 run's record (parity.record) of one training pass from build_pair's start for ``family``, run
    once for both kinds of checkpointing (without any: the same function)."""
    reference = build_reference(family, torch.float32, lora_config(family))
    exact = float64_twin(reference)
    (ids, mask, labels), = batches(reference.config.vocab_size, 1, pad=True)
    exact(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return record(exact)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_checkpointing_runs_cpu_experts_forward_once_where_it_can(family, reentrant):
    """Non-reentrant checkpointing differentiates the first pass's nodes, so its recomputation takes the first
    CPU result instead of running the experts again; reentrant checkpointing differentiates the recomputed
    graph (its first pass ran without grad), so there the experts run twice. Gradients as accurate as HF + PEFT's
    (against the float64 run, parity.assert_as_accurate)."""
    reference, engine = build_pair(family, torch.float32, lora_config(family))
    for model in (reference, engine):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
    engine_state = engine.moecc.engine
    calls = _count_forwards(engine_state)
    (ids, mask, labels), = batches(reference.config.vocab_size, 1, pad=True)
    for model in (reference, engine):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    layers = len(engine.moecc.layers)
    assert len(calls) == (2 * layers if reentrant else layers)
    assert_as_accurate_as_recorded(engine, None, record(reference), _exact_pass(family))
    assert all(not layer.pending_backward for layer in engine.moecc.layers)  # nothing held after backward


def test_forwards_without_backward_leave_nothing_pending():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        engine(input_ids=ids, labels=ids)  # grad enabled, graph dropped unused
    import gc

    gc.collect()
    engine(input_ids=ids, labels=ids)
    assert all(len(layer.pending_backward) <= 2 for layer in engine.moecc.layers)


def test_bf16_checkpoint_replays_read_outputs_the_kernels_have_not_reused():
    """In bf16 the CPU experts' outputs come from the kernels' result pool. A checkpointed region whose
    recomputation reaches the experts (here an op after them saves their output) replays the first job, copying
    its host output to the device again; so that output goes back to the pool only at the job's backward. Had it
    gone back once first copied, the next layer's forward (between this forward and the backward) would have
    written over it. Gradients equal those of the same step without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    _, engine = build_pair("qwen3_moe", torch.bfloat16, lora_config("qwen3_moe"), backend="native")
    first, second = engine.moecc.layers[:2]
    generator = torch.Generator().manual_seed(0)
    tokens, experts, top_k = 24, engine.config.num_experts, engine.config.num_experts_per_tok
    hidden = torch.randn(tokens, engine.config.hidden_size, generator=generator).bfloat16()
    index = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    routing = torch.rand(tokens, top_k, generator=generator).bfloat16()
    calls = _count_forwards(first.engine)

    def region(x):
        return torch.sin(first.submit(x, index, routing).result())  # sin saves the experts' output

    def step(checkpointing):
        engine.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        y = checkpoint(region, x, use_reentrant=False) if checkpointing else region(x)
        second.submit(y, index, routing).result().float().square().sum().backward()
        return [x.grad] + [p.grad.clone() for p in engine.parameters() if p.grad is not None]

    plain = step(False)
    assert first.engine.backend._results._free  # outputs and input gradients went back to the pool
    calls.clear()
    checkpointed = step(True)
    assert len(calls) == 2  # each layer's experts ran once: the recomputation replayed the first
    assert len(plain) == len(checkpointed) > 1
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_outputs_of_layers_on_the_reference_backend_do_not_pile_up_in_the_kernels_pool():
    """gpt-oss's experts run on the reference math under the default backend; their outputs are not the kernels'
    to reuse, so handing them back leaves the pool as it was instead of growing it every step."""
    _, engine = build_pair("gpt_oss", torch.bfloat16, lora_config("gpt_oss"), backend="auto")
    native = engine.moecc.engine.backend.native  # backend="auto": the kernels where they run
    assert native is not None and not any(native.supports(layer.weights) for layer in engine.moecc.layers)
    (ids, mask, labels), = batches(engine.config.vocab_size, 1, pad=True)
    for _ in range(3):
        engine(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert native._results._free == []
