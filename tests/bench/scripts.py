"""Loads a script of benchmarks/ as a module, for tests of its functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` run as a module, with its folder on sys.path (scripts import each other) and
    sys.argv holding only its path (bench_cpu_experts reads it at import)."""
    path = BENCHMARKS / f"{name}.py"
    sys.path.insert(0, str(BENCHMARKS))
    argv, sys.argv = sys.argv, [str(path)]
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.argv = argv
        sys.path.remove(str(BENCHMARKS))
