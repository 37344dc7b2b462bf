"""``MoeccCallback``: moecc inside a Hugging Face ``Trainer`` loop (and TRL's trainers, which are Trainers).

Given a model ``moecc.prepare`` has not seen, the callback prepares it when the trainer is built (``on_init_end``,
which runs before ``train`` creates the optimizer): a ``PeftModel`` the trainer made from ``peft_config`` is adopted
in place (same adapters, same values), a plain model gets the callback's ``lora_config`` (or moecc's default) and
replaces the trainer's model. What cannot be prepared fails there, before training, with a message naming the fix.

It logs the engine's per-step metrics (``moecc/cpu_experts_s``, ``moecc/tokens_per_s``, ``moecc/routing_skew``;
on a CUDA device also ``moecc/h2d_gb``, ``moecc/d2h_gb``, ``moecc/gpu_wait_s``, and without one
``moecc/expert_wait_s``, the training thread's wait for expert results; per optimizer step, averaged over the
logging window) into the printed logs, ``state.log_history`` and every reporting integration. Checkpoints hold
the adapter in PEFT's format because the prepared model is a ``PeftModel``; resuming loads it back in place,
into the expert LoRA factors wherever the engine keeps them (host memory, or the GPU under offload's
``offload_lora``). The experts refuse device moves, so ``Trainer``/``accelerate`` may call ``model.to(device)``
freely. Checkpoints are saved atomically (``moecc.adapter_files``): a run killed mid-save keeps the previous
adapter whole. With ``check_finite`` (the default) the trainable parameters' gradients are checked as backward
accumulates them at every logging step, and a NaN or inf stops training before the optimizer step writes it into
the weights, naming the step and the first parameter (so the layer) whose gradient went non-finite in backward:
checked later, gradient clipping would have spread the NaN to every parameter. At those steps the engine checks
every tensor (``MoeccConfig(check_finite="all")``) as well, so a non-finite expert output or gradient names its MoE
layer as it appears (its inputs and the loss are checked at every step by default).
"""
from __future__ import annotations

import inspect
import sys
import time

import torch
from peft import PeftModel
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ..adapter_files import install_atomic_save
from ..api import prepare
from ..errors import MoeccError
from ..lora import check_finite_gradients

METRIC_PREFIX = "moecc/"
PREPARE_ARGUMENTS = tuple(name for name in inspect.signature(prepare).parameters if name != "model")


def _calling_trainer():
    """The ``Trainer`` whose ``__init__`` is running this callback (found up the call stack), or None."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class MoeccCallback(TrainerCallback):
    """Trainer callback that prepares the trainer's model (unless it is prepared already) and logs its metrics.

    Args:
        check_finite: check gradients for NaN / inf before the optimizer step at logging steps.
        prepare_kwargs: arguments of :func:`moecc.prepare` (``lora_config``, ``adapter``, ``paradigm``,
            ``device``, ``config``) for the model the callback prepares: the trainer's model when it reaches the
            callback unprepared, or one passed to :meth:`prepare`. ``device`` defaults to the trainer's device.
            A model prepared elsewhere, or a ``PeftModel`` together with ``lora_config`` / ``adapter``, is refused,
            since these settings would not apply to it.
    """

    def __init__(self, check_finite: bool = True, **prepare_kwargs) -> None:
        unknown = sorted(set(prepare_kwargs) - set(PREPARE_ARGUMENTS))
        if unknown:
            raise TypeError(f"MoeccCallback got {', '.join(unknown)}, which moecc.prepare does not take; it takes "
                            f"{', '.join(PREPARE_ARGUMENTS)}")
        self.check_finite = check_finite
        self.prepare_kwargs = prepare_kwargs
        self._prepared_here: set[int] = set()  # ids of the models this callback prepared
        self._engine = None
        self._window_steps = 0
        self._window_s = 0.0
        self._totals: dict[str, float] = {}
        self._step_start = 0.0
        self._hooks: list = []
        self._checking = False
        self._first_non_finite: tuple[str, int] | None = None
        self._engine_checks = False  # the engine's check_every_tensor as prepared (kept on at every step if set)

    def prepare(self, model: torch.nn.Module, device=None) -> torch.nn.Module:
        """Prepares ``model`` (plain, or a ``PeftModel`` to adopt) with the arguments this callback was built with."""
        kwargs = dict(self.prepare_kwargs)
        if device is not None:
            kwargs.setdefault("device", device)
        if isinstance(model, PeftModel) and ({"lora_config", "adapter"} & set(kwargs)):
            raise MoeccError(
                "the trainer already applied LoRA to the model (a PeftModel, e.g. from peft_config=...), and "
                "MoeccCallback got lora_config / adapter as well: give the LoRA settings once, either as the "
                "trainer's peft_config or as MoeccCallback(lora_config=...)"
            )
        prepared = prepare(model, **kwargs)
        self._prepared_here.add(id(prepared))
        return prepared

    def _prepared_model(self, args, model: torch.nn.Module) -> torch.nn.Module:
        """The trainer's model, prepared (in place for a ``PeftModel``, swapped into the trainer otherwise)."""
        if getattr(model, "moecc", None) is not None:
            if self.prepare_kwargs and id(model) not in self._prepared_here:
                raise MoeccError(
                    "the trainer's model was already prepared by moecc.prepare, so MoeccCallback's settings "
                    f"({', '.join(sorted(self.prepare_kwargs))}) would not apply to it: drop them from "
                    "MoeccCallback(...), or give the trainer the unprepared model"
                )
            return model
        trainer = _calling_trainer()
        if trainer is None and not isinstance(model, PeftModel):
            raise MoeccError("MoeccCallback found no Trainer to give the prepared model to; prepare it first: "
                             "Trainer(model=moecc.prepare(model, ...), callbacks=[MoeccCallback()])")
        try:
            prepared = self.prepare(model, device=args.device)
        except MoeccError as error:
            raise type(error)(f"MoeccCallback could not prepare the trainer's model: {error}") from None
        if prepared is not model:
            trainer.model = trainer.model_wrapped = prepared
            trainer.callback_handler.model = prepared
        return prepared

    def _engine_of(self, model: torch.nn.Module):
        return model.moecc.engine

    def on_init_end(self, args, state, control, model=None, **kwargs):
        model = self._prepared_model(args, model)
        self._engine = self._engine_of(model)
        self._engine_checks = self._engine.check_every_tensor
        install_atomic_save(model)
        self._go_first()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.check_finite and model is not None and not self._hooks:
            self._hooks = [param.register_post_accumulate_grad_hook(self._gradient_check(name))
                           for name, param in model.named_parameters() if param.requires_grad]

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._engine.check_every_tensor = self._engine_checks

    def _gradient_check(self, name: str):
        def check(param: torch.Tensor) -> None:
            if self._checking and self._first_non_finite is None and not torch.isfinite(param.grad).all():
                self._first_non_finite = (name, int((~torch.isfinite(param.grad)).sum()))
        return check

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._first_non_finite is not None:
            name, count = self._first_non_finite
            raise MoeccError(
                f"step {state.global_step + 1}: the gradient of {name} has {count} non-finite values (NaN or inf), "
                "the first in backward to have any; lower the learning rate, clip gradients (max_grad_norm) or "
                "train in bfloat16 instead of float16"
            )
        if self._checking and model is not None:  # gradients that arrived without an accumulation hook
            check_finite_gradients(model, state.global_step + 1)

    def _go_first(self) -> None:
        """Moves this callback to the front of the Trainer's callback list, so the metrics it adds to ``logs``
        reach the reporting integrations that run after it. The running loop keeps iterating the old list."""
        frame = sys._getframe(1)
        while frame is not None:
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                handler.callbacks = [self] + [c for c in handler.callbacks if c is not self]
                return
            frame = frame.f_back

    def on_step_begin(self, args, state, control, **kwargs):
        self._checking = self.check_finite and _is_logging_step(args, state, state.global_step + 1)
        self._engine.check_every_tensor = self._engine_checks or self._checking
        self._first_non_finite = None
        self._engine.reset_metrics()  # what ran between steps (evaluation) is not training
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available() and self._engine.device.type == "cuda":
            torch.cuda.synchronize(self._engine.device)
        self._window_s += time.perf_counter() - self._step_start
        self._window_steps += 1
        for key, value in self._engine.metrics_since_reset().items():
            self._totals[key] = self._totals.get(key, 0.0) + value

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self._window_steps == 0 or "loss" not in logs:
            return
        steps = self._window_steps
        metrics = {
            METRIC_PREFIX + "cpu_experts_s": self._totals["cpu_experts_s"] / steps,
            METRIC_PREFIX + "tokens_per_s": self._totals["tokens"] / self._window_s if self._window_s else 0.0,
            METRIC_PREFIX + "routing_skew": self._totals["routing_skew"] / steps,
        }
        if self._engine.device.type == "cuda":  # copies between host and device, and the GPU's waits for them
            metrics[METRIC_PREFIX + "h2d_gb"] = self._totals["h2d_gb"] / steps
            metrics[METRIC_PREFIX + "d2h_gb"] = self._totals["d2h_gb"] / steps
            metrics[METRIC_PREFIX + "gpu_wait_s"] = self._totals["gpu_wait_s"] / steps
        else:  # no device: nothing crosses a link; the wait is the training thread's, for the expert results
            metrics[METRIC_PREFIX + "expert_wait_s"] = self._totals["expert_wait_s"] / steps
        metrics = {key: round(value, 6) for key, value in metrics.items()}
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        self._window_steps, self._window_s, self._totals = 0, 0.0, {}


def _is_logging_step(args, state, step: int) -> bool:
    """Whether the Trainer logs at optimizer step ``step`` (``logging_strategy="steps"``)."""
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps":
        return False
    every = state.logging_steps or args.logging_steps
    return step == 1 or step % max(1, int(every)) == 0
