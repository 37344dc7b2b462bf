"""Engine options, and the one place ``MOECC_*`` environment variables are read."""
from __future__ import annotations

import os
from dataclasses import dataclass

BACKENDS = ("reference",)


@dataclass
class MoeccConfig:
    """Options of the CPU expert engine that are not part of the LoRA configuration.

    Attributes:
        num_threads: CPU threads for expert work, the calling thread included; ``None`` uses every CPU this
            process may run on. Environment: ``MOECC_NUM_THREADS``.
        backend: CPU expert math implementation. ``"reference"`` is the plain-PyTorch oracle.
            Environment: ``MOECC_BACKEND``.
        pin_threads: pin pool threads to cores. Environment: ``MOECC_PIN_THREADS`` (0/1).
    """

    num_threads: int | None = None
    backend: str = "reference"
    pin_threads: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown moecc backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None (all CPUs), got {self.num_threads}")

    @classmethod
    def from_env(cls) -> "MoeccConfig":
        """Defaults, overridden by ``MOECC_NUM_THREADS``, ``MOECC_BACKEND`` and ``MOECC_PIN_THREADS``."""
        kwargs: dict = {}
        threads = os.environ.get("MOECC_NUM_THREADS")
        if threads:
            if not threads.strip().isdigit():
                raise ValueError(f"MOECC_NUM_THREADS={threads!r} is not a whole number of threads")
            kwargs["num_threads"] = int(threads)
        if os.environ.get("MOECC_BACKEND"):
            kwargs["backend"] = os.environ["MOECC_BACKEND"]
        pin = os.environ.get("MOECC_PIN_THREADS")
        if pin:
            flags = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
            if pin.strip().lower() not in flags:
                raise ValueError(f"MOECC_PIN_THREADS={pin!r}: use 1/true/yes or 0/false/no")
            kwargs["pin_threads"] = flags[pin.strip().lower()]
        return cls(**kwargs)
