"""Old import path of :mod:`moecc.experts.native`, kept for ``tests/test_native_experts.py`` (which also patches
its functions, so this name is the very module); new code imports ``moecc.experts.native``."""
import sys

from .experts import native

sys.modules[__name__] = native
