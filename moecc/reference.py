"""Old import path of :mod:`moecc.experts.reference`, kept for ``tests/test_native_experts.py``; new code imports
``moecc.experts``."""
from .experts.reference import autograd as experts_autograd
from .experts.reference import backward as experts_backward
from .experts.reference import forward as experts_forward
from .experts.types import ExpertLora, ExpertWeights, LoraGrads, SavedState

__all__ = ["ExpertLora", "ExpertWeights", "LoraGrads", "SavedState", "experts_autograd", "experts_backward",
           "experts_forward"]
