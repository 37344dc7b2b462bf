"""LoRA configuration checks, defaults, expert-adapter discovery and adapter-directory validation.

moecc keeps PEFT's own modules and parameter names, so ``save_pretrained`` writes PEFT's standard format and
``PeftModel.from_pretrained`` reads it back; the engine only reads the expert LoRA factors out of PEFT's
``ParamWrapper`` modules and computes them factorised on the CPU.
"""
from __future__ import annotations

import re
import types

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import ParamWrapper

from .adapter_files import check_adapter_matches, install_atomic_save, read_adapter_config  # noqa: F401 (re-exported)
from .errors import MoeccError, UnsupportedLoraConfigError
from .experts.types import ExpertLora, LoraGrads
from .store import EXPERT_PARAMETERS, quantized_matrices


def default_lora_config(attention_targets: tuple[str, ...], rank: int = 8) -> LoraConfig:
    """LoRA of rank ``rank`` (alpha = 2·rank) on the attention projections and on every routed expert."""
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(attention_targets),
        target_parameters=[f"mlp.experts.{name}" for name in EXPERT_PARAMETERS],
    )


def check_lora_config(config: LoraConfig) -> None:
    """Rejects settings the CPU expert engine cannot compute exactly, naming the setting and the fix."""
    if not isinstance(config, LoraConfig):
        raise UnsupportedLoraConfigError(
            f"lora_config must be a peft.LoraConfig, got {type(config).__name__}; build one with "
            "peft.LoraConfig(r=..., target_modules=[...], target_parameters=['mlp.experts.gate_up_proj', ...])"
        )
    ranks = {"r": config.r, **{f"rank_pattern[{k!r}]": v for k, v in (config.rank_pattern or {}).items()}}
    for name, rank in ranks.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise UnsupportedLoraConfigError(f"LoRA {name}={rank!r}: the rank must be a whole number >= 1 (e.g. r=8)")
    targets = list(config.target_parameters or [])
    for target in targets:
        if target.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS:
            raise UnsupportedLoraConfigError(
                f"target_parameters entry {target!r} is not a routed-expert weight moecc can adapt; "
                f"use names ending in one of {', '.join(EXPERT_PARAMETERS)} (e.g. 'mlp.experts.gate_up_proj')"
            )
    for target in targets:
        if not _names_an_expert_weight(target):
            raise UnsupportedLoraConfigError(
                f"target_parameters entry {target!r} matches no routed-expert weight: PEFT matches it against the "
                "end of names like 'model.layers.0.mlp.experts.gate_up_proj', so it would adapt nothing and the "
                "experts would train untouched; use 'mlp.experts.gate_up_proj' / 'mlp.experts.down_proj'"
            )
    if not targets:
        return
    if config.use_dora:
        raise UnsupportedLoraConfigError(
            "use_dora=True: DoRA on routed experts needs the full W+ΔW norm per expert, which moecc does not "
            "compute; set use_dora=False or drop target_parameters"
        )
    if config.lora_dropout:
        raise UnsupportedLoraConfigError(
            f"lora_dropout={config.lora_dropout}: dropout cannot be applied to expert LoRA (target_parameters) "
            "because the LoRA input is not materialised per adapter; set lora_dropout=0.0"
        )
    if config.lora_bias:
        raise UnsupportedLoraConfigError("lora_bias=True is not supported on routed experts; set lora_bias=False")
    if config.fan_in_fan_out:
        raise UnsupportedLoraConfigError("fan_in_fan_out=True does not apply to fused experts; set it to False")


# The names every supported family gives its fused expert weights; PEFT adapts a parameter when its name equals a
# target_parameters entry or ends with "." + the entry.
_EXPERT_WEIGHT_NAME = ("model", "layers", r"\d+", "mlp", "experts")


def _names_an_expert_weight(target: str) -> bool:
    """Whether ``target`` is a dot-aligned ending of some ``model.layers.<n>.mlp.experts.<weight>``."""
    parts = target.split(".")
    template = [*_EXPERT_WEIGHT_NAME, parts[-1]]
    if len(parts) > len(template):
        return False
    return all(re.fullmatch(pattern, part) for pattern, part in zip(template[-len(parts):], parts))


def check_expert_targets_matched(peft_model: torch.nn.Module, config: LoraConfig) -> None:
    """After ``get_peft_model``: every ``target_parameters`` entry adapted at least one expert weight (an entry
    naming a layer the model does not have adapts nothing, and PEFT only warns)."""
    names = [f"{name}.{wrapper.parameter_name}" for name, wrapper in peft_model.named_modules()
             if isinstance(wrapper, ParamWrapper)]
    names = [name.replace(".base_layer", "") for name in names]
    for target in config.target_parameters or []:
        if not any(name == target or name.endswith("." + target) for name in names):
            raise UnsupportedLoraConfigError(
                f"target_parameters entry {target!r} matched no parameter of this model (the experts would train "
                "untouched); check the layer number, or use 'mlp.experts.gate_up_proj' for every layer"
            )


def non_finite_gradients(model: torch.nn.Module) -> list[tuple[str, int]]:
    """``(parameter name, count)`` of every trainable parameter whose gradient holds NaN or inf."""
    return [(name, int((~torch.isfinite(p.grad)).sum())) for name, p in model.named_parameters()
            if p.requires_grad and p.grad is not None and not torch.isfinite(p.grad).all()]


def check_finite_gradients(model: torch.nn.Module, step: int) -> None:
    """Raises MoeccError naming the first layer whose LoRA gradient is not finite at optimizer step ``step``."""
    bad = non_finite_gradients(model)
    if bad:
        name, count = bad[0]
        raise MoeccError(
            f"step {step}: the gradient of {name} has {count} non-finite values (NaN or inf)"
            + (f", and {len(bad) - 1} more parameters do" if len(bad) > 1 else "")
            + "; lower the learning rate, clip gradients (max_grad_norm) or train in bfloat16 instead of float16"
        )


def expert_wrappers(experts: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, ParamWrapper]]:
    """Unwraps PEFT's nested ``ParamWrapper`` modules around a fused experts module.

    Returns:
        ``(base experts module, {parameter name: wrapper})`` for each adapted expert parameter.
    """
    wrappers: dict[str, ParamWrapper] = {}
    module = experts
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def expert_lora(wrapper: ParamWrapper | None) -> ExpertLora | None:
    """The LoRA factors the wrapper would apply right now, or None when it applies none.

    Follows PEFT's state: no LoRA while adapters are disabled (``disable_adapter()``) or merged into the base
    weights (``merge_adapter()``, which writes into the very tensors the engine reads), and the factors of the
    active adapter otherwise.
    """
    if wrapper is None or wrapper.disable_adapters or wrapper.merged:
        return None
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if not active:
        return None
    if len(active) > 1:
        raise UnsupportedLoraConfigError(
            f"adapters {active} are active together on routed experts; moecc applies one at a time: "
            "call model.set_adapter(name) with a single adapter"
        )
    name = active[0]
    return ExpertLora(
        A=wrapper.lora_A[name].weight,
        B=wrapper.lora_B[name].weight,
        scaling=float(wrapper.scaling[name]),
        num_experts=wrapper.num_experts,
    )


def layer_lora(wrappers: dict) -> tuple[ExpertLora | None, ExpertLora | None]:
    """(gate_up, down) LoRA factors a layer's PEFT wrappers would apply now, None where they apply none."""
    return expert_lora(wrappers.get("gate_up_proj")), expert_lora(wrappers.get("down_proj"))


def track_merges(wrappers: dict) -> None:
    """Counts every ``merge`` / ``unmerge`` of these PEFT wrappers (on the instances), for :func:`merge_revision`:
    the merged-adapter list alone can come back to an earlier value while the weights hold other values (merge,
    unmerge, new LoRA values, merge again: bf16 round trips and new deltas, in the same tensors)."""
    for wrapper in wrappers.values():
        if getattr(wrapper, "_moecc_merges", None) is not None:
            continue
        wrapper._moecc_merges = 0
        # Bound methods (not closures), so a deep copy of the model counts on its own wrappers.
        wrapper.merge = types.MethodType(_counted_merge, wrapper)
        wrapper.unmerge = types.MethodType(_counted_unmerge, wrapper)


def _counted_merge(self, *args, **kwargs):
    held = quantized_matrices(self.get_base_layer())
    if held:
        raise MoeccError(merge_refusal(next(iter(held.values())).format))
    self._moecc_merges += 1
    return type(self).merge(self, *args, **kwargs)


def _counted_unmerge(self, *args, **kwargs):
    self._moecc_merges += 1
    return type(self).unmerge(self, *args, **kwargs)


def merge_refusal(formats: str) -> str:
    """Why PEFT cannot merge adapters into experts held in ``formats``, and what to do instead."""
    return (f"cannot merge LoRA into the routed experts: moecc holds their frozen weights in {formats} (one "
            "quantized copy; no bf16 weights to add the update to). Save the adapter (model.save_pretrained(dir)) "
            "and merge it into the bf16 base model with PEFT (PeftModel.from_pretrained(base, dir)"
            ".merge_and_unload()), or prepare the model with MoeccConfig(expert_format='bf16') to merge in place")


def refuse_merges(peft_model: torch.nn.Module, formats: str) -> None:
    """Makes every PEFT merge of ``peft_model`` (``merge_adapter``, ``merge_and_unload``) fail before it merges
    anything, because its experts are held in ``formats``: PEFT checks whether merging is allowed first."""
    tuner = peft_model.base_model
    tuner._check_merge_allowed = types.MethodType(_refused_merge, tuner)
    tuner._moecc_refused_formats = formats


def _refused_merge(self, *args, **kwargs):
    raise MoeccError(merge_refusal(self._moecc_refused_formats))


def merge_revision(wrappers: dict) -> tuple:
    """A value that changes whenever PEFT merges adapters into (or out of) the wrapped expert weights: the
    merged adapters and, where :func:`track_merges` counts them, how many merges and unmerges there were."""
    return tuple((name, tuple(w.merged_adapters), getattr(w, "_moecc_merges", 0))
                 for name, w in sorted(wrappers.items()))


def lora_tensors(loras: tuple[ExpertLora | None, ExpertLora | None]) -> list:
    """``[A_gate_up, B_gate_up, A_down, B_down]`` (None where absent): autograd Function inputs."""
    return [t for lora in loras for t in ((lora.A, lora.B) if lora else (None, None))]


def factor_gradients(loras: tuple[ExpertLora | None, ExpertLora | None], grads: LoraGrads) -> list:
    """The gradients matching :func:`lora_tensors`, on each factor's device and in its dtype."""
    gate_up, down = loras
    out = []
    for lora, grad_a, grad_b in ((gate_up, grads.gate_up_A, grads.gate_up_B), (down, grads.down_A, grads.down_B)):
        if lora is None:
            out += [None, None]
        else:
            out += [grad_a.to(lora.A.device, lora.A.dtype), grad_b.to(lora.B.device, lora.B.dtype)]
    return out
