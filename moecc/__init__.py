"""moecc: LoRA fine-tuning of Mixture-of-Experts models whose routed experts run on the CPU.

    import moecc
    model = moecc.prepare(hf_moe_model, lora_config=peft.LoraConfig(...))
    model(input_ids=..., labels=...).loss.backward()
    model.save_pretrained("adapter/")
"""
from .api import MoeccState, default_lora_config, from_pretrained, prepare
from .config import MoeccConfig
from .errors import (
    AdapterMismatchError,
    MoeccError,
    UnsupportedDtypeError,
    UnsupportedLoraConfigError,
    UnsupportedModelError,
)
from .models import FAMILIES

__version__ = "0.1.0"
SUPPORTED_FAMILIES = tuple(sorted(FAMILIES))

__all__ = [
    "AdapterMismatchError",
    "MoeccConfig",
    "MoeccError",
    "MoeccState",
    "SUPPORTED_FAMILIES",
    "UnsupportedDtypeError",
    "UnsupportedLoraConfigError",
    "UnsupportedModelError",
    "default_lora_config",
    "from_pretrained",
    "prepare",
]
