"""The offload paradigm: copies only what is routed, reuses device slots, follows PEFT merges, GPU budget."""
from __future__ import annotations

import pytest
import torch

import moecc

from ..parity import assert_grads_match, batches, build_pair, lora_config, rel_err


def _expert_bytes(engine, experts: int) -> int:
    weights = engine.moecc.layers[0].host_weights
    return experts * (weights.gate_up[0].nbytes + weights.down[0].nbytes)


def test_copies_only_routed_experts_and_reuses_slots():
    _, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="offload")
    state = engine.moecc
    state.engine.reset_metrics()
    ids = torch.tensor([[5]])
    with torch.no_grad():
        engine(input_ids=ids)
    routed = sum(len(layer.last_experts) for layer in state.layers)
    assert routed == 2 * len(state.layers)  # one token, k = 2: two experts per layer, nothing else
    assert state.engine.metrics_since_reset()["h2d_gb"] * 1e9 == pytest.approx(_expert_bytes(engine, routed))
    state.engine.reset_metrics()
    with torch.no_grad():
        engine(input_ids=ids)  # both layers' slots are still resident (2 slots, 2 layers)
    assert state.engine.metrics_since_reset()["h2d_gb"] == 0


def test_large_batch_prefetches_next_layer_and_training_matches():
    reference, engine = build_pair("qwen2_moe", torch.float32, lora_config("qwen2_moe"), paradigm="offload",
                                   num_hidden_layers=3)
    engine.moecc.engine.capacity = 2  # fewer slots than layers: slots are evicted and refilled
    for ids, mask, labels in batches(256, 3, batch=4, seq=16, seed=2):
        a = reference(input_ids=ids, attention_mask=mask, labels=labels)
        b = engine(input_ids=ids, attention_mask=mask, labels=labels)
        assert rel_err(b.logits, a.logits) <= 1e-5
        a.loss.backward()
        b.loss.backward()
    assert_grads_match(reference, engine, 1e-4)
    assert engine.moecc.engine.metrics_since_reset()["h2d_gb"] > 0


def test_merge_adapter_refreshes_device_copies():
    reference, engine = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"), paradigm="offload")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine(input_ids=ids)  # fill the slots
        for model in (reference, engine):
            model.merge_adapter()
        assert rel_err(engine(input_ids=ids).logits, reference(input_ids=ids).logits) <= 1e-5


@pytest.mark.gpu
def test_offload_on_cuda_matches_and_respects_budget():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference, engine = build_pair("deepseek_v3", torch.float32, lora_config("deepseek_v3"), paradigm="offload",
                                   device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    (ids, mask, labels), = batches(256, 1, seed=3)
    a = reference(input_ids=ids, attention_mask=mask, labels=labels)
    b = engine(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
    assert rel_err(b.logits, a.logits) <= 1e-4
    b.loss.backward()
    assert all(p.is_pinned() for layer in engine.moecc.layers for p in layer.experts.parameters(recurse=False))
    from moecc.tiny_models import tiny_model

    with pytest.raises(moecc.MoeccError, match="too small"):
        moecc.prepare(tiny_model("qwen3_moe"), paradigm="offload", device="cuda",
                      config=moecc.MoeccConfig(gpu_memory_budget_gb=1e-6))
