"""MoE family adapters, looked up by ``config.model_type``."""
from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from .base import MoeFamily, install_block_forward
from .deepseek_v3 import DeepseekV2Family, DeepseekV3Family
from .gpt_oss import GptOssFamily
from .mixtral import MixtralFamily
from .olmoe import OlmoeFamily
from .qwen2_moe import Qwen2MoeFamily
from .qwen3_moe import Qwen3MoeFamily

FAMILIES: dict[str, MoeFamily] = {
    family.model_type: family
    for family in (Qwen3MoeFamily(), Qwen2MoeFamily(), DeepseekV3Family(), DeepseekV2Family(), MixtralFamily(),
                   OlmoeFamily(), GptOssFamily())
}


def family_for(model: torch.nn.Module) -> MoeFamily:
    """The adapter for ``model`` (a transformers model), or UnsupportedModelError listing supported families."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({type(model).__name__}) is not a MoE family moecc supports; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES[model_type]
    family.check_config(config)
    return family


__all__ = ["FAMILIES", "MoeFamily", "family_for", "install_block_forward"]
