"""Causal-LM loss without the full logits tensor.

A Hugging Face causal LM computes ``logits`` for every position (``[T, vocab]``, upcast to float32 for the loss),
then cross-entropy. With Qwen3's 151,936-token vocabulary that is 0.6 MB per token for the logits alone and about
three times that with the float32 copy and the softmax gradient: 15 GB at 8192 tokens, more than every
decoder layer's activations together. ``chunked_causal_lm_loss`` runs the decoder, then the output head and
cross-entropy over ``chunk_tokens`` positions at a time, each chunk checkpointed (its logits recomputed in
backward), so only one chunk's logits exist at once. The loss and gradients equal the model's own
(``model(input_ids, labels=labels).loss``: mean over the positions whose shifted label is not -100).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # Hugging Face's label for positions that do not count


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder stack (``.model``) and output head (``.lm_head``) of a causal LM, under PEFT wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if decoder is None or head is None:
        raise TypeError(f"chunked_causal_lm_loss needs a Hugging Face causal LM with .model and .lm_head; "
                        f"got {type(base).__name__}. Use model(input_ids=..., labels=...).loss instead")
    return decoder, head


def _chunk_loss_sum(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # [n, vocab]
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                           attention_mask: torch.Tensor | None = None, chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``input_ids`` against ``labels`` ([B, S] each), computing
    the output head ``chunk_tokens`` positions at a time.

    Same value and gradients as ``model(input_ids=..., attention_mask=..., labels=...).loss`` for a Hugging Face
    causal LM (plain or PEFT-wrapped, with or without moecc); peak memory of the head drops from
    ``3 x T x vocab x 4`` bytes to ``3 x chunk_tokens x vocab x 4``. One difference: when no label counts
    (all -100), this returns 0 with zero gradients where the model's loss is NaN. A model moecc prepared checks the
    loss as its own forward does (``MoeccConfig.check_finite``).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    decoder, head = _decoder_and_head(model)
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError("chunked_causal_lm_loss computes the language-model loss only, and this model's config has "
                         "output_router_logits=True (a router auxiliary loss is added to .loss); use "
                         "model(input_ids=..., labels=...).loss, or set config.output_router_logits = False")
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, S, H]
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [B*(S-1), H]: position s predicts token s+1
    targets = labels[:, 1:].reshape(-1).to(hidden.device)  # [B*(S-1)]
    count = (targets != IGNORE_INDEX).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, head, hidden[piece], targets[piece], use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, hidden[piece], targets[piece])
    loss = total / count.clamp(min=1)
    checks = getattr(decoder, "moecc_batch_checks", None)  # a model moecc prepared: its loss check
    if checks is not None:
        checks.check_loss(loss, None)
    return loss
