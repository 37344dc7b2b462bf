"""Integrations with training frameworks: the Hugging Face ``Trainer`` callback."""
from .trainer import MoeccCallback

__all__ = ["MoeccCallback"]
