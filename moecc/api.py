"""Public entry point: ``prepare`` turns a Hugging Face MoE model into a LoRA model whose experts run on the CPU."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict
from tqdm import tqdm

from . import _ops
from .config import MoeccConfig
from .errors import MoeccError, UnsupportedDtypeError, UnsupportedModelError
from .adapter_files import install_atomic_save, read_settings, warn_if_format_differs
from .batch_checks import install_batch_checks
from .engine_summary import log_prepared
from .lora import (check_adapter_matches, check_expert_targets_matched, check_lora_config, expert_wrappers,
                   read_adapter_config, refuse_merges, track_merges)
from .lora import default_lora_config as _default_lora_config
from .models import MoeFamily, family_for, install_block_forward
from .paradigms import PARADIGMS, Engine, ExpertLayer, choose_paradigm, engine_class
from .paradigms.base import BUDGET_SLACK, resident_weight_bytes
from .store import (SUPPORTED_DTYPES, check_host_experts, expert_format, keep_on_host, quantize_experts,
                    quantized_matrices, return_freed_memory, target_format)

ADAPTER_NAME = "default"


@dataclass
class MoeccState:
    """What ``prepare`` attaches to the returned model as ``model.moecc``."""

    family: MoeFamily
    paradigm: str
    device: torch.device
    engine: Engine
    layers: list[ExpertLayer]
    config: MoeccConfig

    @property
    def expert_bytes(self) -> int:
        """Bytes of frozen expert weights held in host memory (quantized ones with their scales)."""
        return sum(_held_bytes(layer.weights) for layer in self.layers)

    @property
    def expert_format(self) -> str:
        """The format the routed experts' frozen weights are held in (``"int4"``, ``"bfloat16"``...); layers held
        differently (a checkpoint that left some unquantized) are listed, joined by ``+``."""
        return "+".join(sorted({layer.weights.format for layer in self.layers}))


def _held_bytes(weights) -> int:
    pairs = ((weights.gate_up, weights.gate_up_q), (weights.down, weights.down_q))
    return sum(tensor.nbytes if quantized is None else quantized.nbytes for tensor, quantized in pairs)


def default_lora_config(model: torch.nn.Module, rank: int = 8) -> LoraConfig:
    """LoRA of rank ``rank`` (alpha = 2·rank) on ``model``'s attention projections and on all routed experts."""
    return _default_lora_config(family_for(model).attention_targets, rank=rank)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device for attention / dense layers: the given one, else CUDA if available, else CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoeccError(f"device={str(device)!r} but CUDA is not available; pass device='cpu' or leave it None")
    if device.type not in ("cuda", "cpu"):
        raise MoeccError(f"device type {device.type!r} is not supported; use a CUDA device or 'cpu'")
    return device


def _check_model(model: torch.nn.Module) -> None:
    params = list(model.parameters())
    if any(p.device.type == "meta" for p in params):
        raise UnsupportedModelError(
            "the model has weights on the 'meta' device (loaded with device_map/offload?); load it fully into "
            "host memory (device_map=None, or device_map='cpu') and let moecc place it"
        )
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    bad = [d for d in dtypes if d not in SUPPORTED_DTYPES]
    if bad:
        raise UnsupportedDtypeError(
            f"model weights are {bad[0]}; moecc supports bfloat16, float16 and float32. Load with "
            "torch_dtype=torch.bfloat16"
        )


def _refuse_lora_layers(model: torch.nn.Module) -> None:
    """A plain model whose modules already hold PEFT LoRA layers was prepared (or given to ``get_peft_model``)
    before: both change it in place, and PEFT would fail wrapping the same expert parameter a second time."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    wrapped = next((name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)), None)
    if wrapped is not None:
        raise MoeccError(
            f"this model already carries LoRA layers ({wrapped!r} is a PEFT {type(model.get_submodule(wrapped)).__name__}"
            "): it was prepared by moecc (or given to get_peft_model) before, and both change the model in place, so "
            "its expert parameters would be targeted twice. Use the model that call returned (prepare a model once), "
            "or load a fresh copy of the base model"
        )


def _sparse_blocks(model: torch.nn.Module, family: MoeFamily) -> list[tuple[str, torch.nn.Module]]:
    block_class = family.block_class()
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, block_class)]
    if not blocks:
        raise UnsupportedModelError(
            f"no {family.block_class_name} found in this {family.model_type} model: either every layer is dense, "
            "or the model was loaded with trust_remote_code and uses its own block classes; load it without "
            "trust_remote_code so transformers' own implementation is used"
        )
    return blocks


def _apply_lora(model: torch.nn.Module, family: MoeFamily, lora_config: LoraConfig | None,
                adapter: str | Path | None) -> PeftModel:
    if adapter is not None:
        if lora_config is not None:
            raise MoeccError("pass either lora_config (new adapter) or adapter (existing directory), not both")
        config = read_adapter_config(adapter)
        config.inference_mode = False
        check_lora_config(config)
        peft_model = _lora_model(model, config, lambda m: check_adapter_matches(m, adapter))
        set_peft_model_state_dict(peft_model, load_peft_weights(str(adapter), device="cpu"),
                                  adapter_name=ADAPTER_NAME)
        return peft_model
    config = lora_config if lora_config is not None else _default_lora_config(family.attention_targets)
    check_lora_config(config)
    return _lora_model(model, config)


def _adopt(model: PeftModel, lora_config: LoraConfig | None, adapter: str | Path | None) -> PeftModel:
    """A ``PeftModel`` built outside moecc (TRL's ``peft_config``, a user's ``get_peft_model``): its adapters are
    kept as they are (same modules, same values) once their settings pass the checks ``prepare`` makes."""
    if getattr(model, "moecc", None) is not None:
        raise MoeccError("this model was already prepared by moecc; use it as it is (prepare it once)")
    if lora_config is not None or adapter is not None:
        raise MoeccError(
            f"the PeftModel already carries LoRA (adapters {sorted(model.peft_config)}), so lora_config / adapter "
            "would be a second one: pass the PeftModel alone to adopt its adapters, or the plain transformers model "
            "(peft_model.unload()) with lora_config / adapter"
        )
    for name, config in model.peft_config.items():
        if not isinstance(config, LoraConfig):
            raise MoeccError(f"adapter {name!r} of the PeftModel is {type(config).__name__}; moecc trains LoRA only "
                             "(peft.LoraConfig, with target_parameters for the experts)")
        check_lora_config(config)
        check_expert_targets_matched(model, config)
    return model


def _settings(adapter: str | Path | None, paradigm: str | None, config: MoeccConfig | None):
    """``(paradigm, config)``: the ones given, else those saved beside ``adapter`` (``moecc_config.json``, with
    ``MOECC_*`` variables that are set taking precedence), else ``"cocompute"`` and the environment's."""
    saved = read_settings(adapter) if adapter is not None else None
    env = MoeccConfig.from_env()
    if config is None and saved and saved.get("config"):
        fields = {f.name for f in dataclasses.fields(MoeccConfig)}
        defaults = MoeccConfig()
        config = MoeccConfig(**{k: v for k, v in saved["config"].items() if k in fields})
        for name in fields:  # a variable set now wins over the saved value
            if getattr(env, name) != getattr(defaults, name):
                setattr(config, name, getattr(env, name))
    if paradigm is None:
        paradigm = (saved or {}).get("paradigm", "cocompute")
    return paradigm, config or env


def _lora_model(model: torch.nn.Module, config: LoraConfig, check=lambda peft_model: None) -> PeftModel:
    """``get_peft_model``, then checks that every expert target adapted something (PEFT only warns) and
    ``check``; on a refusal the caller's model is left as it was, so a retry with another config works."""
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    try:
        check_expert_targets_matched(peft_model, config)
        check(peft_model)
    except MoeccError:
        peft_model.unload()
        raise
    return peft_model


def prepare(
    model: torch.nn.Module,
    lora_config: LoraConfig | None = None,
    adapter: str | Path | None = None,
    paradigm: str | None = None,
    device: str | torch.device | None = None,
    config: MoeccConfig | None = None,
) -> PeftModel:
    """Makes a transformers MoE model trainable with LoRA while its routed experts stay in host memory.

    Args:
        model: a transformers MoE causal LM (``AutoModelForCausalLM``), weights in host memory; or a
            ``peft.PeftModel`` of one (built by TRL from ``peft_config``, or by ``get_peft_model``), whose LoRA is
            adopted as it is: same adapters, same values.
        lora_config: LoRA for attention/dense (``target_modules``) and experts (``target_parameters``, e.g.
            ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``). Default: rank 8 on attention + experts.
        adapter: path of a PEFT adapter directory to keep training instead of a new LoRA; its
            ``moecc_config.json`` (written by moecc's saves) supplies ``paradigm`` and ``config`` not given here.
        paradigm: a name in ``moecc.paradigms.PARADIGMS``: ``"cocompute"`` (the default), routed experts computed
            on the CPU; ``"offload"``, copied to the device and computed there; ``"hybrid"``, each layer's experts
            split between both, at once; or ``"auto"``, which picks one and logs why
            (``moecc.paradigms.choose_paradigm``).
        device: device for attention, dense layers, routers and shared experts; default CUDA if available.
        config: engine options (threads, backend, ``expert_format``); default from ``MOECC_*`` environment
            variables. A quantized ``expert_format`` holds the routed experts in that format, converted layer by
            layer once PEFT's LoRA exists (shaped from the bf16 weights), which leaves the bf16 parameters as
            shape-only placeholders; it needs a bfloat16 model and the co-compute paradigm, and PEFT's merges are
            refused.

    Returns:
        A ``peft.PeftModel``: call it like the original, train ``model.parameters()``, ``save_pretrained`` a
        standard PEFT adapter (atomically: an interrupted save leaves the previous adapter whole, see
        ``moecc.adapter_files``, with moecc's settings in ``moecc_config.json``). ``model.moecc`` holds the engine
    state and metrics. One line on logger ``moecc`` says what runs where.
    """
    paradigm, config = _settings(adapter, paradigm, config)
    config.check()  # again: fields may have been set after the config was made
    device = resolve_device(device)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    family = family_for(base)
    _check_model(base)
    if not isinstance(model, PeftModel):
        _refuse_lora_layers(base)
    blocks = _sparse_blocks(base, family)
    base_experts = [expert_wrappers(block.experts)[0] for _, block in blocks]
    # Checked before anything changes, so a refusal leaves the model as it was
    targets = [target_format(experts, name, config.expert_format, config.int4_group_size)
               for experts, (name, _) in zip(base_experts, blocks)]
    held = sorted({target or expert_format(experts) for experts, target in zip(base_experts, targets)
                   if target is not None or quantized_matrices(experts)})
    paradigm = _paradigm_for_formats(paradigm, held)
    paradigm = choose_paradigm(paradigm, device, getattr(base, "config", None), config.offload_slots)
    paradigm_engine = engine_class(paradigm)
    for _, block in blocks:
        block.experts.to("cpu")  # LoRA factors get created (or stay) next to the weights, in host memory
    if isinstance(model, PeftModel):
        peft_model = _adopt(model, lora_config, adapter)
    else:
        peft_model = _apply_lora(model, family, lora_config, adapter)
    _quantize_layers(base_experts, targets, config.int4_group_size)

    # The one place the native pool is set: the config's threads, else what the paradigm wants on this device
    _ops.configure_pool(config.num_threads or paradigm_engine.pool_threads(device), config.pin_threads)
    engine = paradigm_engine.from_config(device, config)
    engine.check_finite = config.check_finite is not False
    engine.check_every_tensor = config.check_finite == "all"
    for name, block in blocks:
        keep_on_host(block.experts)
        experts, wrappers = expert_wrappers(block.experts)
        track_merges(wrappers)  # device copies and packed copies of the weights follow every merge
        check_host_experts(experts, name)
        install_block_forward(block, family, engine.add_layer(name, experts, wrappers))
    if held:
        refuse_merges(peft_model, ", ".join(held))
    engine.finish(peft_model, config)
    apply_gpu_budget(peft_model, engine, config)
    peft_model.to(device)
    peft_model.moecc = MoeccState(family, paradigm, device, engine, engine.layers, config)
    if adapter is not None:
        warn_if_format_differs(peft_model.moecc, read_settings(adapter) or {}, adapter)
    install_atomic_save(peft_model)  # save_pretrained writes to a temporary name and renames
    install_batch_checks(peft_model.get_base_model(), peft_model.moecc)
    log_prepared(peft_model.moecc, config)
    return peft_model


def _paradigm_for_formats(paradigm: str, held: list[str]) -> str:
    """``paradigm`` where the experts are held in ``held`` formats (quantized; none: any paradigm): co-compute
    computes on the quantized copy, so ``"auto"`` picks it; offload and hybrid copy bf16 weights to the device."""
    if not held:
        return paradigm
    formats = ", ".join(held)
    if paradigm == "auto":
        logging.getLogger("moecc").info("paradigm='auto' chose 'cocompute': the experts are held in %s, which the "
                                        "CPU computes on in place", formats)
        return "cocompute"
    if paradigm in PARADIGMS and paradigm != "cocompute":
        raise MoeccError(
            f"paradigm={paradigm!r} computes the experts on the device from unquantized copies, but they are held in "
            f"{formats}: "
            f"quantized experts run under paradigm='cocompute'. Use it, or expert_format='bf16' for {paradigm} "
            "(moecc.from_pretrained dequantizes a quantized checkpoint while loading)")
    return paradigm


def _quantize_layers(experts: list[torch.nn.Module], targets: list[str | None], group: int) -> None:
    """Holds each layer's experts in its target format, layer by layer: host memory peaks at the quantized copies
    plus one layer's float weights."""
    work = [(module, target) for module, target in zip(experts, targets) if target is not None]
    formats = ", ".join(sorted({target for _, target in work}))
    for module, target in tqdm(work, desc=f"quantizing experts to {formats}", unit="layer", disable=not work):
        quantize_experts(module, target, group)
    if work:
        return_freed_memory()


def apply_gpu_budget(model: torch.nn.Module, engine: Engine, config: MoeccConfig) -> None:
    """Checks that what stays on the GPU fits ``config.gpu_memory_budget_gb`` and caps the allocator there."""
    budget = config.gpu_memory_budget_gb
    if budget is None or engine.device.type != "cuda":
        return
    needed_gb = (resident_weight_bytes(model) + engine.gpu_bytes(config)) / 1e9 * BUDGET_SLACK
    if needed_gb > budget:
        raise MoeccError(
            f"gpu_memory_budget_gb={budget:g} is too small: the parts that stay on the GPU ({engine.name}) need "
            f"about {needed_gb:.1f} GB before activations; raise the budget{engine.budget_advice()}"
        )
    cap_gpu_memory(engine.device, budget)


def cap_gpu_memory(device: torch.device, budget_gb: float | None) -> None:
    """Caps this process's allocator on ``device`` at ``budget_gb``, so an allocation past it fails (nothing to
    do without a budget or off CUDA)."""
    if budget_gb is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * 1e9 / total), index)


def from_pretrained(
    path: str | Path,
    lora_config: LoraConfig | None = None,
    adapter: str | Path | None = None,
    paradigm: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "auto",
    config: MoeccConfig | None = None,
) -> PeftModel:
    """Loads a local MoE checkpoint directory and prepares it (see :func:`prepare` for the other arguments).

    ``dtype`` is read as transformers reads it: ``"auto"`` (default) keeps the checkpoint's dtype (config.json's
    ``dtype`` / ``torch_dtype``), a name (``"bfloat16"``, ``"torch.float32"``) or a ``torch.dtype`` picks one.
    The native CPU kernels run bfloat16 experts; other dtypes run the reference backend (``prepare`` logs which).

    Checkpoints may store experts per expert (as originally published) or fused. Shards are read one at a
    time: experts go once into host memory, in ``config.expert_format`` (each layer converted once its shard is
    read), everything else straight to ``device``, so host memory peaks near the experts' size in that format plus
    one shard. FP8 checkpoints with 128 x 128 block scales (DeepSeek-V3, Qwen3 ``-FP8``) and MXFP4 ones (gpt-oss)
    keep their format under ``expert_format="auto"`` (their other weights are dequantized to ``dtype``, which must
    be bfloat16), are dequantized under ``"bf16"`` and requantized from their bf16 values under another format;
    other quantized checkpoints are refused with instructions.
    """
    from .loading import checkpoint_format, load_model

    paradigm, config = _settings(adapter, paradigm, config)
    stored = checkpoint_format(path)
    held = {"auto": stored, "bf16": None}.get(config.expert_format, config.expert_format)
    paradigm = _paradigm_for_formats(paradigm, [held] if held else [])  # refused before anything is read
    model = load_model(path, dtype, resolve_device(device), config.expert_format, config.int4_group_size)
    return prepare(model, lora_config=lora_config, adapter=adapter, paradigm=paradigm, device=device, config=config)
