"""The paradigm interface: every ``model.moecc`` accessor under every registered paradigm, and a paradigm added
through the registry alone."""
from __future__ import annotations

import pytest
import torch

import moecc
from moecc.experts import reference
from moecc.paradigms import PARADIGMS, Engine, ExpertLayer
from moecc.paradigms.base import Ready
from moecc.tiny_models import tiny_model

from ..parity import batches, build_pair, float64_twin, forward_backward_exact, lora_config

# Without a CUDA device (these tests): nothing crosses a link, no GPU waits.
COMMON_METRICS = {"cpu_experts_s", "host_copy_in_gb", "host_copy_out_gb", "expert_wait_s", "tokens", "routing_skew"}


@pytest.mark.parametrize("paradigm", sorted(PARADIGMS))
def test_every_state_accessor_works_under_every_paradigm(paradigm):
    _, model = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm=paradigm)
    state = model.moecc
    assert state.paradigm == paradigm and isinstance(state.engine, PARADIGMS[paradigm])
    assert state.family.model_type == "qwen3_moe" and state.device.type == "cpu"
    assert isinstance(state.config, moecc.MoeccConfig)
    assert state.layers == state.engine.layers and [layer.index for layer in state.layers] == [0, 1]
    assert state.expert_bytes == sum(p.nbytes for n, p in model.named_parameters()
                                     if n.endswith(("gate_up_proj", "down_proj")))
    for layer in state.layers:
        assert isinstance(layer, ExpertLayer) and layer.engine is state.engine
        assert layer.weights.num_experts == layer.experts.gate_up_proj.shape[0]
        assert all(part is not None for part in layer.lora()) and layer.revision() == layer.weights.revision
    state.engine.reset_metrics()
    (ids, _, labels), = batches(model.config.vocab_size, 1, batch=2, seq=5)
    model(input_ids=ids, labels=labels).loss.backward()
    metrics = state.engine.metrics_since_reset()
    assert COMMON_METRICS <= set(metrics) and metrics["tokens"] == ids.numel()
    assert not {"h2d_gb", "d2h_gb", "gpu_wait_s"} & set(metrics)  # no device, no device names
    assert set(state.engine.counters_since_reset()) >= {"h2d_gb", "d2h_gb", "gpu_wait_s"}
    assert state.engine.metrics.tokens_routed >= 0 and state.engine.metrics.routing_skew >= 1.0


class _EagerLayer(ExpertLayer):
    """The reference's autograd formulation on the device, in place: a paradigm in a dozen lines."""

    def submit(self, hidden, top_k_index, top_k_weights):
        self.begin_call(hidden)
        return Ready(reference.autograd(self.weights, hidden, top_k_index, top_k_weights, *self.lora()))


class _EagerEngine(Engine):
    name = "eager"
    layer_class = _EagerLayer

    @classmethod
    def from_config(cls, device, config):
        return cls(device)

    def reset_metrics(self):
        self.metrics.reset()

    def counters_since_reset(self):
        return {"tokens": float(self.metrics.tokens)}


def test_a_registered_paradigm_is_prepared_like_the_others(monkeypatch):
    monkeypatch.setitem(PARADIGMS, "eager", _EagerEngine)
    reference_model, model = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="eager")
    assert isinstance(model.moecc.engine, _EagerEngine) and len(model.moecc.layers) == 2
    batch, = batches(model.config.vocab_size, 1, seed=3)
    forward_backward_exact(reference_model, model, float64_twin(reference_model), batch)
    assert model.moecc.engine.metrics_since_reset()["tokens"] == batch[0].numel()


def test_unknown_paradigm_lists_the_registered_ones():
    with pytest.raises(moecc.MoeccError, match="paradigm 'eager' is not available; choose one of "
                                               + ", ".join(PARADIGMS)):
        moecc.prepare(tiny_model("qwen3_moe"), paradigm="eager", device="cpu")


@pytest.mark.parametrize("paradigm", ["cocompute", "offload", "hybrid"])
def test_a_forked_child_computes_the_same_logits(paradigm):
    """After os.fork() the child has none of the parent's threads (moecc's pool, the engine's worker, torch's
    OpenMP team); it must still run the model, not wait for ever, and get the parent's logits."""
    import os
    import time

    model = moecc.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16), device="cpu", paradigm=paradigm)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # the parent's pools and worker are running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the same logits
        try:
            with torch.no_grad():
                os._exit(0 if torch.equal(model(input_ids=ids).logits, expected) else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung (waited 60 s)")


def test_worker_jobs_run_with_autograd_off():
    """The CPU part's jobs record no graph: a view of a LoRA factor taken on the worker while the caller passes
    the same factor to an autograd Function could deadlock the two threads in torch."""
    from moecc.paradigms.base import Worker

    worker = Worker("moecc-test")
    factor = torch.zeros(4, 2, requires_grad=True)
    assert worker.submit(torch.is_grad_enabled).result() is False
    assert worker.submit(lambda: (factor * 2).grad_fn).result() is None
    assert torch.is_grad_enabled()  # the caller's mode is its own
