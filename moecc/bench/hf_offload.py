"""The stock Hugging Face route for a model bigger than the GPU, as a benchmark baseline (paradigm ``hf-offload``).

PEFT LoRA goes on the whole model, then accelerate's big-model dispatch (``dispatch_model``) places it: every
routed-experts module (``...mlp.experts``, PEFT wrappers included) is "offloaded" — its tensors, all E experts
and their LoRA factors, stay in a host-memory state dict, are copied to the GPU when that module's forward starts
and are dropped when it ends. Attention, dense layers, routers, norms and embeddings live on the GPU. No moecc
code runs inside the model.

Two things about this route are checked rather than assumed:
- PEFT's fused-experts LoRA reads its factors and the base weight as attributes instead of calling the modules
  that hold them, so accelerate's per-module hooks would leave them on the meta device. Each experts module is
  therefore loaded whole at the start of its forward (``preload_module_classes``, which accelerate offers for
  exactly such modules).
- accelerate swaps fresh GPU tensors into an offloaded module at each forward, so the LoRA tensors an optimizer
  holds for that module may never get a gradient; :func:`untrained_expert_lora` says whether they do.
"""
from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from ..models import family_for


def expert_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the routed-experts modules in ``model`` (a transformers MoE model, with or without PEFT)."""
    block_class = family_for(model).block_class()
    return [f"{name}.experts" for name, module in model.named_modules() if isinstance(module, block_class)]


def offload_device_map(model: torch.nn.Module, experts: list[str], device: int | str,
                       experts_to: str = "cpu") -> dict[str, int | str]:
    """An accelerate device map: each module named in ``experts`` on ``experts_to``, every other one on ``device``.

    A module that holds an experts module is split into its children, so the map names disjoint modules.
    """
    device_map: dict[str, int | str] = {}

    def place(module: torch.nn.Module, name: str) -> None:
        prefix = f"{name}." if name else ""
        if name in experts:
            device_map[name] = experts_to
        elif not any(expert.startswith(prefix) for expert in experts):
            device_map[name] = device
        else:
            own = [n for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
            if own:
                raise ValueError(f"{name or 'the model'} holds tensors {own} beside an experts module; an "
                                 "accelerate device map places whole modules, so these cannot stay on the GPU alone")
            for child_name, child in module.named_children():
                place(child, prefix + child_name)

    place(model, "")
    return device_map


def build(base: torch.nn.Module, lora_config: LoraConfig, device: torch.device,
          offload_dir: str | None = None) -> PeftModel:
    """``base`` with PEFT LoRA, dispatched by accelerate with its routed experts offloaded to host memory.

    Args:
        base: a transformers MoE causal LM with its weights in host memory; it is changed in place.
        lora_config: the LoRA to train (``moecc.api.default_lora_config`` in the benchmark).
        device: the CUDA device for everything but the routed experts.
        offload_dir: keep the experts in files in this folder instead of host memory (accelerate's "disk"
            offload: the same hooks, loading from files). With ``device`` = CPU this runs the route on a machine
            without a GPU, which is how its tests check it.
    """
    if device.type == "cuda":
        target: int | str = device.index if device.index is not None else torch.cuda.current_device()
    elif device.type == "cpu" and offload_dir is not None:
        target = "cpu"
    else:
        raise ValueError(f"hf-offload places the model on a CUDA device, got {device}; on a machine without one, "
                         "pass offload_dir to offload the experts to disk instead")
    skip_keys = sorted(getattr(base, "_skip_keys_device_placement", None) or [])
    model = get_peft_model(base, lora_config)
    experts = expert_module_names(model)
    device_map = offload_device_map(model, experts, target, experts_to="disk" if offload_dir else "cpu")
    preload = sorted({type(model.get_submodule(name)).__name__ for name in experts})
    from accelerate import dispatch_model

    return dispatch_model(model, device_map, main_device=target, offload_dir=offload_dir, offload_buffers=True,
                          skip_keys=skip_keys or None, preload_module_classes=preload)


def untrained_expert_lora(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the expert LoRA of a :func:`build` model would not train, or None when it gets gradients.

    Runs one forward and backward on 8 tokens and looks at the expert LoRA tensors an optimizer made before it
    would hold (``model.parameters()`` as they are now).
    """
    experts = expert_module_names(model)
    held = {name: param for name, param in model.named_parameters()
            if param.requires_grad and any(name.startswith(f"{expert}.") for expert in experts)}
    if not held:
        return None
    ids = torch.randint(0, model.config.vocab_size, (1, 8), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    missing = [name for name, param in held.items() if param.grad is None]
    model.zero_grad(set_to_none=True)
    for param in held.values():
        param.grad = None
    if not missing:
        return None
    return (f"expert LoRA does not train: {len(missing)} of {len(held)} expert LoRA tensors the optimizer holds "
            "get no gradient (accelerate swaps in fresh copies at each forward); timed anyway, attention LoRA only")
