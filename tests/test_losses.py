"""chunked_causal_lm_loss against the model's own loss: value and every gradient."""
from __future__ import annotations

import pytest
import torch

from moecc.losses import chunked_causal_lm_loss

from .parity import (assert_as_accurate, assert_grads_as_accurate, assert_grads_match, batches, build_pair,
                     float64_twin, lora_config, rel_err)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_matches_model_loss_and_gradients(family, chunk_tokens):
    reference, engine = build_pair(family, torch.float32, lora_config(family))
    exact = float64_twin(reference)
    (ids, mask, labels), = batches(reference.config.vocab_size, 1, batch=2, seq=12, seed=3, pad=True)
    expected, exact_loss = (model(input_ids=ids, attention_mask=mask, labels=labels).loss
                            for model in (reference, exact))
    actual = chunked_causal_lm_loss(engine, ids, labels, attention_mask=mask, chunk_tokens=chunk_tokens)
    for loss in (expected, exact_loss, actual):
        loss.backward()
    assert_as_accurate(actual, expected, exact_loss, "loss")
    assert_grads_as_accurate(reference, engine, exact)


def test_plain_peft_model_and_no_grad():
    reference, _ = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    exact = float64_twin(reference)
    (ids, _, labels), = batches(reference.config.vocab_size, 1, seed=5)
    with torch.no_grad():
        expected, exact_loss = (model(input_ids=ids, labels=labels).loss for model in (reference, exact))
        actual = chunked_causal_lm_loss(reference, ids, labels, chunk_tokens=5)
    assert not actual.requires_grad
    assert_as_accurate(actual, expected, exact_loss, "loss")


def test_only_ignored_labels_give_zero_not_nan():
    reference, _ = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    ids = torch.randint(0, reference.config.vocab_size, (1, 6))
    loss = chunked_causal_lm_loss(reference, ids, torch.full_like(ids, -100))
    assert loss.item() == 0.0


def test_bad_inputs_say_what_to_do():
    reference, _ = build_pair("qwen3_moe", torch.float32, lora_config("qwen3_moe"))
    ids = torch.randint(0, reference.config.vocab_size, (1, 6))
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss(reference, ids, ids, chunk_tokens=0)
    with pytest.raises(TypeError, match="causal LM"):
        chunked_causal_lm_loss(torch.nn.Linear(2, 2), ids, ids)
    reference.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits"):
        chunked_causal_lm_loss(reference, ids, ids)


def test_bf16_model_with_native_kernels_agrees_to_bf16_rounding():
    """The default engine (native kernels on bf16 experts): the chunked loss and its gradients agree with the
    model's own loss to bf16 rounding (the head and the loss run in the same dtypes either way)."""
    import copy

    import moecc
    from moecc.tiny_models import tiny_model

    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    engines = [moecc.prepare(copy.deepcopy(base), lora_config=lora_config("qwen3_moe")) for _ in range(2)]
    engines[1].load_state_dict(engines[0].state_dict())
    (ids, mask, labels), = batches(engines[0].config.vocab_size, 1, batch=2, seq=16, seed=9, pad=True)
    device = engines[0].get_input_embeddings().weight.device  # the GPU side: a CUDA GPU where there is one
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    expected = engines[0](input_ids=ids, attention_mask=mask, labels=labels).loss
    actual = chunked_causal_lm_loss(engines[1], ids, labels, attention_mask=mask, chunk_tokens=5)
    expected.backward()
    actual.backward()
    assert rel_err(actual, expected) <= 1e-2
    assert_grads_match(engines[0], engines[1], 5e-2)
