"""What a prepared model checks around its forward: the batch before anything runs, the loss after.

Before the decoder runs (a forward pre-hook on it, so ``model(...)``, ``generate`` and ``chunked_causal_lm_loss``
all pass through): ``input_ids`` must be a ``[batch, sequence]`` integer tensor with at least one token, every id
inside the embedding's vocabulary (one host read of their min and max), and the host memory the pass needs at
least (the CPU experts' saved activations, and on the CPU device the decoder's own) must be there. Refusing there
leaves nothing changed. After the causal LM's forward (a forward hook), under ``MoeccConfig.check_finite``, a NaN or
inf loss is an error naming the step and, where every counted label is -100, that cause.
"""
from __future__ import annotations

import torch

from .errors import MoeccError
from .experts import native
from .losses import IGNORE_INDEX

ID_DTYPES = (torch.int64, torch.int32)  # what torch's embedding takes
SAVED_BYTES = 2  # the CPU experts keep their activations in bf16 at least (float32 models: more)


class BatchChecks:
    """The checks of one prepared model; held by its decoder and causal LM as ``moecc_batch_checks``."""

    def __init__(self, state, embeddings: torch.nn.Embedding, config) -> None:
        self.state = state  # the model's MoeccState: paradigm, device, engine, layers
        self.vocabulary = embeddings.num_embeddings
        self.activation_bytes = embeddings.weight.dtype.itemsize
        self.hidden = config.hidden_size
        self.top_k = getattr(config, "num_experts_per_tok", 1)
        self.decoder_layers = config.num_hidden_layers
        self.intermediate = [layer.weights.intermediate_size for layer in state.layers]  # per MoE layer

    def check_batch(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
        if input_ids is None and inputs_embeds is None:
            return  # the decoder's own error says so
        if input_ids is not None:
            check_ids_shape(input_ids)
            tokens = input_ids.numel()
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[0] * inputs_embeds.shape[1] == 0:
                raise MoeccError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}: it must be [batch, sequence, "
                                 "hidden] with at least one token")
            tokens = inputs_embeds.shape[0] * inputs_embeds.shape[1]
        self.check_host_memory(tokens, torch.is_grad_enabled())
        if input_ids is not None:
            check_ids_range(input_ids, self.vocabulary)

    def host_bytes(self, tokens: int, training: bool) -> int:
        """Host memory a pass of ``tokens`` takes at least: each CPU-computed MoE layer keeps its inputs and gate/up
        activations (``[T, H]`` and ``[T·k, 2I]``, bf16, with the routing) from forward to backward; on the CPU
        device the decoder keeps one ``[T, H]`` per layer for backward too (two are alive at once without)."""
        per_layer = [SAVED_BYTES * (self.hidden + self.top_k * 2 * inter) + 12 * self.top_k  # + ids and weights
                     for inter in self.intermediate] if self.state.paradigm == "cocompute" else []
        experts = (sum(per_layer) if training else max(per_layer)) if per_layer else 0
        decoder = 0
        if self.state.device.type == "cpu":
            decoder = self.hidden * self.activation_bytes * (self.decoder_layers if training else 2)
        return tokens * (experts + decoder)

    def check_host_memory(self, tokens: int, training: bool) -> None:
        """Refuses a pass whose :meth:`host_bytes` exceed the memory available plus the host buffers moecc holds
        for reuse (what the last pass of this size allocated)."""
        needed = self.host_bytes(tokens, training)
        available = native._available_host_bytes()
        if available is None or needed == 0:
            return
        held = getattr(getattr(self.state.engine, "backend", None), "fresh_bytes", 0)
        if needed > available + held:
            raise MoeccError(
                f"a {'training' if training else 'no-grad'} pass of {tokens:,} tokens needs at least "
                f"{needed / 1e9:.1f} GB of host memory ({self.state.paradigm} on {self.state.device.type}: the CPU "
                f"experts' saved activations{' and the decoder' if self.state.device.type == 'cpu' else ''}), but "
                f"{(available + held) / 1e9:.1f} GB is available; use fewer tokens per step (a smaller batch or "
                "shorter sequences, with gradient accumulation to keep the effective batch)")

    def check_loss(self, loss: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Under ``check_finite``: a NaN / inf loss is an error naming the step (one host read of the loss)."""
        engine = self.state.engine
        if not (engine.check_finite or engine.check_every_tensor) or bool(torch.isfinite(loss.detach()).all()):
            return
        step = engine.forward_passes
        if labels is not None and not bool((labels[..., 1:] != IGNORE_INDEX).any()):
            raise MoeccError(
                f"step {step}: the loss is {loss.item()} because no label counts: every label after the first "
                f"position of each sequence is {IGNORE_INDEX} (ignored), or the sequences are one token long, so "
                "the mean over counted tokens is 0 / 0. Give each batch at least one label that is not -100 (or "
                "skip it); MoeccConfig(check_finite=False) turns this check off")
        raise MoeccError(
            f"step {step}: the loss is {loss.item()} (non-finite) although every MoE layer's inputs were finite: the "
            "last MoE layer's output or what follows it (final norm, output head) overflowed, which "
            "MoeccConfig(check_finite='all') narrows down; lower the learning rate, clip gradients or train in "
            "bfloat16 instead of float16 (MoeccConfig(check_finite=False) turns this check off)")


def check_ids_shape(input_ids: torch.Tensor) -> None:
    """``input_ids`` is a ``[batch, sequence]`` tensor of integer ids holding at least one token."""
    if not isinstance(input_ids, torch.Tensor):
        raise MoeccError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}; use "
                         "tokenizer(..., return_tensors='pt')")
    if input_ids.dtype not in ID_DTYPES:
        raise MoeccError(f"input_ids must hold integer token ids (torch.long or torch.int32), got {input_ids.dtype}; "
                         "the tokenizer's ids (return_tensors='pt') are torch.long: pass those, or input_ids.long()")
    if input_ids.dim() != 2:
        raise MoeccError(f"input_ids has shape {tuple(input_ids.shape)}: it must be [batch, sequence]"
                         + ("; for one sequence pass input_ids.unsqueeze(0)" if input_ids.dim() == 1 else ""))
    if input_ids.numel() == 0:
        raise MoeccError(f"input_ids has shape {tuple(input_ids.shape)}: an empty batch (no tokens to run); give "
                         "at least one sequence of at least one token (skip empty batches in the data loader)")


def check_ids_range(input_ids: torch.Tensor, vocabulary: int) -> None:
    """Every id lies in ``[0, vocabulary)`` (one host read of the min and max)."""
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
    if low >= 0 and high < vocabulary:
        return
    bad = ((input_ids < 0) | (input_ids >= vocabulary)).nonzero()[0].tolist()
    raise MoeccError(
        f"input_ids hold token ids outside the vocabulary [0, {vocabulary}): {input_ids[tuple(bad)].item()} at "
        f"position {tuple(bad)} (min {low}, max {high}); the tokenizer does not match the model, or tokens were "
        "added to it without model.resize_token_embeddings(len(tokenizer))")


def _before_decoder(module: torch.nn.Module, args: tuple, kwargs: dict):
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    module.moecc_batch_checks.check_batch(input_ids, kwargs.get("inputs_embeds"))


def _after_causal_lm(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    labels = kwargs.get("labels")
    loss = getattr(output, "loss", None) if not isinstance(output, tuple) else (output[0] if labels is not None
                                                                                else None)
    if isinstance(loss, torch.Tensor):
        module.moecc_batch_checks.check_loss(loss, labels)


def install_batch_checks(causal_lm: torch.nn.Module, state) -> None:
    """Adds the checks to ``causal_lm`` (the transformers model inside the PEFT wrapper) for ``state``."""
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else None
    embeddings = causal_lm.get_input_embeddings()
    if decoder is None or embeddings is None:
        return
    checks = BatchChecks(state, embeddings, causal_lm.config)
    decoder.moecc_batch_checks = causal_lm.moecc_batch_checks = checks
    decoder.register_forward_pre_hook(_before_decoder, with_kwargs=True)
    causal_lm.register_forward_hook(_after_causal_lm, with_kwargs=True)
