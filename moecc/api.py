"""Public entry point: ``prepare`` turns a Hugging Face MoE model into a LoRA model whose experts run on the CPU."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict

from . import _ops
from .config import MoeccConfig
from .errors import AdapterMismatchError, MoeccError, UnsupportedDtypeError, UnsupportedModelError
from .lora import check_adapter_matches, check_lora_config, expert_wrappers, read_adapter_config, track_merges
from .lora import default_lora_config as _default_lora_config
from .models import MoeFamily, family_for, install_block_forward
from .paradigms import PARADIGMS
from .paradigms.cocompute import CoComputeEngine, CoComputeLayer
from .paradigms.offload import OffloadEngine, OffloadLayer
from .store import SUPPORTED_DTYPES, check_host_experts, keep_on_host

ADAPTER_NAME = "default"


@dataclass
class MoeccState:
    """What ``prepare`` attaches to the returned model as ``model.moecc``."""

    family: MoeFamily
    paradigm: str
    device: torch.device
    engine: CoComputeEngine | OffloadEngine
    layers: list
    config: MoeccConfig

    @property
    def expert_bytes(self) -> int:
        """Bytes of frozen expert weights held in host memory."""
        return sum(layer.weights.gate_up.nbytes + layer.weights.down.nbytes for layer in self.layers)


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
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
        try:
            check_adapter_matches(peft_model, adapter)
        except AdapterMismatchError:
            peft_model.unload()  # leave the caller's model as it was, so a retry with another adapter works
            raise
        set_peft_model_state_dict(peft_model, load_peft_weights(str(adapter), device="cpu"),
                                  adapter_name=ADAPTER_NAME)
        return peft_model
    config = lora_config if lora_config is not None else _default_lora_config(family.attention_targets)
    check_lora_config(config)
    return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def prepare(
    model: torch.nn.Module,
    lora_config: LoraConfig | None = None,
    adapter: str | Path | None = None,
    paradigm: str = "cocompute",
    device: str | torch.device | None = None,
    config: MoeccConfig | None = None,
) -> PeftModel:
    """Makes a transformers MoE model trainable with LoRA while its routed experts stay in host memory.

    Args:
        model: a transformers MoE causal LM (``AutoModelForCausalLM``), weights in host memory.
        lora_config: LoRA for attention/dense (``target_modules``) and experts (``target_parameters``, e.g.
            ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``). Default: rank 8 on attention + experts.
        adapter: path of a PEFT adapter directory to keep training instead of a new LoRA.
        paradigm: ``"cocompute"``: routed experts computed on the CPU; ``"offload"``: copied to the device and
            computed there.
        device: device for attention, dense layers, routers and shared experts; default CUDA if available.
        config: engine options (threads, backend); default from ``MOECC_*`` environment variables.

    Returns:
        A ``peft.PeftModel``: call it like the original, train ``model.parameters()``, ``save_pretrained`` a
        standard PEFT adapter. ``model.moecc`` holds the engine state and metrics.
    """
    if paradigm not in PARADIGMS:
        raise MoeccError(f"paradigm {paradigm!r} is not available; choose one of {', '.join(PARADIGMS)}")
    config = config or MoeccConfig.from_env()
    device = resolve_device(device)
    if isinstance(model, PeftModel):
        raise MoeccError("pass the plain transformers model; moecc applies LoRA itself (lora_config / adapter)")
    family = family_for(model)
    _check_model(model)
    blocks = _sparse_blocks(model, family)
    for _, block in blocks:
        block.experts.to("cpu")  # LoRA factors get created next to the weights, in host memory
    peft_model = _apply_lora(model, family, lora_config, adapter)

    _ops.configure_pool(config.num_threads, config.pin_threads)
    if paradigm == "offload":
        engine = OffloadEngine(device, config.offload_slots, cache_bytes=int(config.offload_cache_gb * 1e9))
    else:
        engine = CoComputeEngine(device, config.backend, config.isa, prepack=config.prepack_weights)
    layers = []
    for index, (name, block) in enumerate(blocks):
        keep_on_host(block.experts)
        base_experts, wrappers = expert_wrappers(block.experts)
        track_merges(wrappers)  # device copies and packed copies of the weights follow every merge
        check_host_experts(base_experts, name)
        if paradigm == "offload":
            if device.type == "cuda":
                pin_experts(base_experts)
            layer = OffloadLayer(name, base_experts, wrappers, engine, index)
            engine.layers.append(layer)
        else:
            layer = CoComputeLayer(name, base_experts, wrappers, engine, index)
        install_block_forward(block, family, layer)
        layers.append(layer)
    if paradigm == "cocompute" and engine.native is not None:
        engine.native.prepack_layers(layers)
    if paradigm == "offload":
        engine.lora_on_device = offload_lora_on_device(peft_model, layers, device, config)
        engine.place_lora(_expert_lora_params(layers))  # after keep_on_host moved the experts' subtree to host
    apply_gpu_budget(peft_model, layers, paradigm, device, config)
    peft_model.to(device)
    peft_model.moecc = MoeccState(family, paradigm, device, engine, layers, config)
    return peft_model


def _expert_lora_params(layers: list) -> list[torch.nn.Parameter]:
    """The layers' expert LoRA factors (every adapter's), each once."""
    params = {id(p): p for layer in layers for wrapper in layer.wrappers.values()
              for name, p in wrapper.named_parameters() if "lora_" in name}
    return list(params.values())


def _expert_lora_bytes(layers: list) -> int:
    """Bytes of the layers' expert LoRA factors (float32 masters)."""
    return sum(p.nbytes for p in _expert_lora_params(layers))


def _resident_gpu_bytes(model: torch.nn.Module, layers: list, paradigm: str, config: MoeccConfig,
                        lora_on_device: bool) -> int:
    """What stays on the GPU before activations: the non-expert weights and, for offload, its slots, its cache,
    and with ``lora_on_device`` the expert LoRA factors, their gradients and two AdamW moments."""
    resident = sum(p.nbytes for n, p in model.named_parameters() if ".experts." not in n)
    if paradigm == "offload":
        resident += config.offload_slots * max(layer.experts.gate_up_proj.nbytes + layer.experts.down_proj.nbytes
                                               for layer in layers)
        resident += int(config.offload_cache_gb * 1e9)
        if lora_on_device:
            resident += 4 * _expert_lora_bytes(layers)
    return resident


# The estimate's margin for the activations of a small batch and allocator slack.
_SLACK = 1.1


def offload_lora_on_device(model: torch.nn.Module, layers: list, device: torch.device, config: MoeccConfig) -> bool:
    """Whether offload keeps the expert LoRA factors on ``device`` (see ``MoeccConfig.offload_lora``). Under
    ``"auto"``: when the factors, their gradients and two AdamW moments (4x the float32 factors) take at most a
    quarter of the GPU budget (of the GPU's memory without one) and everything else that stays on the GPU still
    fits the budget beside them; always off CUDA, where host and device are one memory."""
    if config.offload_lora != "auto":
        return config.offload_lora == "device"
    if device.type != "cuda":
        return True
    state = 4 * _expert_lora_bytes(layers)
    if config.gpu_memory_budget_gb is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return state <= torch.cuda.get_device_properties(index).total_memory / 4
    budget = config.gpu_memory_budget_gb * 1e9
    return (state <= budget / 4
            and _resident_gpu_bytes(model, layers, "offload", config, lora_on_device=True) * _SLACK <= budget)


def pin_experts(experts: torch.nn.Module) -> None:
    """Moves one experts module's weights into page-locked host memory (the copies replace the originals).
    Offload copies them to the device every layer call; from pageable memory each such copy would stall the host
    while CUDA stages it."""
    for param in experts.parameters(recurse=False):
        if not param.is_pinned():
            param.data = param.data.pin_memory()


def apply_gpu_budget(model: torch.nn.Module, layers: list, paradigm: str, device: torch.device,
                     config: MoeccConfig) -> None:
    """Checks that what stays on the GPU fits ``config.gpu_memory_budget_gb`` and caps the allocator there."""
    budget = config.gpu_memory_budget_gb
    if budget is None or device.type != "cuda":
        return
    lora_on_device = paradigm == "offload" and bool(layers) and layers[0].engine.lora_on_device
    needed_gb = _resident_gpu_bytes(model, layers, paradigm, config, lora_on_device) / 1e9 * _SLACK
    if needed_gb > budget:
        raise MoeccError(
            f"gpu_memory_budget_gb={budget:g} is too small: the parts that stay on the GPU ({paradigm}) need about "
            f"{needed_gb:.1f} GB before activations; raise the budget"
            + (" or lower offload_slots / offload_cache_gb" if paradigm == "offload" else "")
            + (" or keep the expert LoRA in host memory (offload_lora='host')" if lora_on_device else "")
        )
    cap_gpu_memory(device, budget)


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
    paradigm: str = "cocompute",
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
    config: MoeccConfig | None = None,
) -> PeftModel:
    """Loads a local MoE checkpoint directory and prepares it (see :func:`prepare` for the arguments).

    Checkpoints may store experts per expert (as originally published) or fused. Shards are read one at a
    time: experts go once into host memory, everything else straight to ``device``, so host memory peaks near
    the experts' size plus one shard. Quantized checkpoints are refused with instructions.
    """
    from .loading import load_model

    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(f"dtype={dtype}; moecc supports torch.bfloat16, torch.float16, torch.float32")
    model = load_model(path, dtype, resolve_device(device))
    return prepare(model, lora_config=lora_config, adapter=adapter, paradigm=paradigm, device=device, config=config)
