"""Compare where expert work runs, for your own model, from the Python API.

Times LoRA training steps of the same model and batch under each paradigm that can run here and prints a
table: ``cocompute`` (moecc: routed experts on the CPU), ``offload`` (moecc: experts copied to the device and
computed there), ``hybrid`` (moecc: each layer's experts split between both, at once) and ``gpu`` (plain Hugging Face + PEFT with the whole model on the GPU, when there is one and
it fits).

    python examples/compare_paradigms.py                       # a small built-in model
    python examples/compare_paradigms.py --model path/to/ckpt --tokens 2048 --steps 3
"""
from __future__ import annotations

import argparse
import copy

import moecc  # before torch: torch's OpenMP threads then sleep between ops (moecc/__init__.py)
import torch
from peft import get_peft_model

from moecc.bench.timing import time_training
from moecc.tiny_models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local checkpoint directory (default: a built-in model)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per step")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.model:
        from moecc.loading import load_model

        base = load_model(args.model, torch.bfloat16, torch.device("cpu"))
    else:
        base = tiny_model("qwen3_moe", dtype=torch.float32, hidden_size=256, moe_intermediate_size=128,
                          num_experts=16, num_experts_per_tok=4)
    lora = moecc.default_lora_config(base)
    rows = {}
    print(f"model {base.config.model_type}, {args.tokens} tokens per step, device {device}")
    if device.type == "cuda":
        try:
            plain = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora)).to(device)
            rows["gpu"] = time_training(plain, device, args.tokens, args.steps)
            del plain
            torch.cuda.empty_cache()
        except torch.OutOfMemoryError:
            rows["gpu"] = "does not fit on the GPU"
    else:
        rows["gpu"] = "no GPU"
    for paradigm in ("cocompute", "offload", "hybrid"):
        model = moecc.prepare(copy.deepcopy(base), lora_config=copy.deepcopy(lora), device=device, paradigm=paradigm)
        rows[paradigm] = time_training(model, device, args.tokens, args.steps)
        del model
    print(f"{'paradigm':<10} {'step s':>8} {'tokens/s':>10} {'peak GPU GB':>12}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<10} {row}")
        else:
            print(f"{name:<10} {row['step_s']:>8.3f} {row['tokens_per_s']:>10.0f} {row['peak_gpu_gb']:>12.2f}")


if __name__ == "__main__":
    main()
