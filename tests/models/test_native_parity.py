"""Whole-model parity of the default engine (native CPU kernels where they apply) with HF + PEFT in bf16.

The native kernels apply LoRA factorised in float32 instead of folding ``W + s·B·A`` into a bf16 weight as
PEFT does, so they cannot agree with HF + PEFT bit for bit (the reference backend does; see test_api.py).
What they must do is be as accurate: measured against the same model in float32 (HF + PEFT, the exact
answer), moecc's bf16 error may not exceed twice HF + PEFT's own bf16 error (two independent bf16 pipelines
with errors of the same size differ by up to about that much per tensor).
"""
from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model

import moecc
from moecc.experts.native import NativeExperts
from moecc.tiny_models import tiny_model

from ..parity import assert_as_accurate, batches, lora_config, randomize_lora

BF16 = dict(factor=2.0, floor=2e-3)  # assert_as_accurate's bound in bf16

FAMILIES = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "mixtral", "olmoe"]


def _loss_and_grads(model, ids, mask, labels):
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.float(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_default_engine_is_as_accurate_as_hf_peft_in_bf16(family):
    base = tiny_model(family, dtype=torch.bfloat16, seed=0)
    hf_bf16 = get_peft_model(copy.deepcopy(base), lora_config(family))
    randomize_lora(hf_bf16, 100)
    exact = copy.deepcopy(hf_bf16).float()  # same weights and adapters, float32 arithmetic
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config(family), device="cpu")
    engine.load_state_dict(hf_bf16.state_dict())
    layers = engine.moecc.layers
    assert all(NativeExperts.supports(layer.weights) for layer in layers)  # the default really is native here
    (ids, mask, labels), = batches(hf_bf16.config.vocab_size, 1, pad=True)
    logits_exact, grads_exact = _loss_and_grads(exact, ids, mask, labels)
    logits_hf, grads_hf = _loss_and_grads(hf_bf16, ids, mask, labels)
    logits_eng, grads_eng = _loss_and_grads(engine, ids, mask, labels)
    assert_as_accurate(logits_eng, logits_hf, logits_exact, "logits", **BF16)
    assert grads_eng.keys() == grads_hf.keys()
    for name, exact_grad in grads_exact.items():
        assert_as_accurate(grads_eng[name], grads_hf[name], exact_grad, name, **BF16)


def test_default_engine_trains_like_hf_peft_in_bf16():
    family = "qwen3_moe"
    base = tiny_model(family, dtype=torch.bfloat16, seed=1)
    hf_bf16 = get_peft_model(copy.deepcopy(base), lora_config(family))
    randomize_lora(hf_bf16, 7)
    exact = copy.deepcopy(hf_bf16).float()
    engine = moecc.prepare(copy.deepcopy(base), lora_config=lora_config(family), device="cpu")
    engine.load_state_dict(hf_bf16.state_dict())
    losses = {}
    for key, model in (("exact", exact), ("hf", hf_bf16), ("moecc", engine)):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        losses[key] = []
        for ids, mask, labels in batches(hf_bf16.config.vocab_size, 1, seed=4) * 6:  # one batch, learnt
            optimizer.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses[key].append(loss.item())
    assert losses["moecc"][-1] < losses["moecc"][0]  # it learns
    # bf16 trajectories wander chaotically around the exact one, so compare the worst step of each.
    drift = {key: max(abs(a - b) for a, b in zip(losses[key], losses["exact"])) for key in ("hf", "moecc")}
    assert drift["moecc"] <= 2 * drift["hf"] + 2e-3 * losses["exact"][0], drift
    trained = zip(exact.named_parameters(), hf_bf16.parameters(), engine.parameters())
    for (name, p_exact), p_hf, p_eng in trained:
        if p_exact.requires_grad:
            assert_as_accurate(p_eng, p_hf, p_exact, name, **BF16)
