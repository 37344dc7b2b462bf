"""Engine options, and the one place ``MOECC_*`` environment variables are read."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown moecc backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None (all CPUs), got {self.num_threads}")

    @classmethod
    def from_env(cls) -> "MoeccConfig":
        """Defaults, overridden by ``MOECC_NUM_THREADS``, ``MOECC_BACKEND`` and ``MOECC_PIN_THREADS``."""
        kwargs: dict = {}
        if os.environ.get("MOECC_NUM_THREADS"):
            kwargs["num_threads"] = int(os.environ["MOECC_NUM_THREADS"])
        if os.environ.get("MOECC_BACKEND"):
            kwargs["backend"] = os.environ["MOECC_BACKEND"]
        if os.environ.get("MOECC_PIN_THREADS"):
            kwargs["pin_threads"] = os.environ["MOECC_PIN_THREADS"] not in ("0", "false", "False")
        return cls(**kwargs)
