"""The two private torch APIs the paradigms rely on, looked up once at import so a torch without them fails here,
with a message, instead of deep inside a backward pass.

- ``torch._C._current_graph_task_id``: which autograd graph task (backward pass) the calling thread runs, so a
  layer knows whether its forward is a checkpointed recomputation and whose pass a CPU part's error belongs to.
- the autograd engine's ``queue_callback``: runs a function when the current backward pass ends, where hybrid joins
  the CPU parts the device waited for on its own.
"""
from __future__ import annotations

import torch

try:
    current_graph_task_id = torch._C._current_graph_task_id
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback
except AttributeError as missing:  # pragma: no cover - only on a torch that dropped them
    raise ImportError(
        f"moecc needs two private torch APIs this torch ({torch.__version__}) lacks: {missing}. They exist in torch "
        "2.1 through at least 2.13; install one of those versions"
    ) from None
