"""The ``moecc`` command line. Library code never parses arguments; this module does.

    moecc info      CPU features and kernel ISA, threads, GPU, library versions
"""
from __future__ import annotations

import argparse
import platform
import sys


def info() -> dict:
    """What this machine offers moecc: CPU features, the kernel ISA ``auto`` picks, threads, GPU, versions."""
    import peft
    import torch
    import transformers

    from . import __version__, _ops

    features = _ops.cpu_features()
    gpu = "none"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return {
        "moecc": __version__,
        "cpu": features.pop("brand").strip() or platform.processor(),
        "cpu_features": ", ".join(name for name, present in features.items() if present) or "none",
        "kernel_isa": _ops.best_isa(),
        "threads": _ops.num_threads(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moecc", description="LoRA fine-tuning of MoE models with CPU experts")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="CPU features and kernel ISA, threads, GPU, versions")
    args = parser.parse_args(argv)
    if args.command == "info":
        for key, value in info().items():
            print(f"{key:>14}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
