"""moecc: LoRA fine-tuning of Mixture-of-Experts models whose routed experts run on the CPU.

    import moecc
    model = moecc.prepare(hf_moe_model, lora_config=peft.LoraConfig(...))
    model(input_ids=..., labels=...).loss.backward()
    model.save_pretrained("adapter/")
"""
import os as _os
import sys as _sys

# PyTorch's OpenMP threads busy-wait after each parallel op (GNU OpenMP: up to ~20 ms on a recent Xeon) on the
# same cores moecc's kernel threads are pinned to, slowing the kernel phases that follow; on the 16-core Xeon
# host a 256-token layer's backward took 66 ms under the default instead of 37. PASSIVE makes them sleep at
# once. OpenMP reads this when torch loads, so it only takes effect when moecc is imported first; otherwise
# NativeExperts warns (see _check_omp_wait_policy).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
