"""benchmarks/profile_hybrid.py with one more case: ``old`` is the engine's own split with the LoRA blocks selected
from the ``[out, r, E]`` view, as before 0562e10 (call 3 of this folder's README). Run from the repository root:

    PYTHONPATH=. python benchmarks/results/host_2026-12-04_s23/ab_driver.py --layers 48 --tokens 512 --rules own:2,old:2
"""
import sys
import torch
sys.path.insert(0, "benchmarks")
import profile_hybrid as ph
import moecc.paradigms.hybrid_parts as hp

new_select = hp._select_blocks


def old_select(grad, experts, which, index, out=None):
    grouped = grad.view(hp._grouped_shape(grad.shape, experts, which, experts))
    dim = 2 if which % 2 else 0
    if out is None:
        return grouped.index_select(dim, index)
    torch.index_select(grouped, dim, index, out=out)
    return out


class Rules(dict):
    def get(self, key, default=None):
        hp._select_blocks = old_select if key == "old" else new_select
        return super().get(key, default)


ph.RULES = Rules(ph.RULES)
ph.main()
