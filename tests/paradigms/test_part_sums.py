"""The helpers of moecc/paradigms/part_sums.py that move the CPU part's LoRA gradients by expert."""
from __future__ import annotations

import pytest
import torch

from moecc.paradigms.part_sums import _blocks_matrix, _grouped, _select_blocks
from moecc.paradigms.part_sums import grouped_shape as _grouped_shape


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_selected_blocks_are_each_experts_own_rows_or_columns(which):
    """A gradient ``[r*E, in]`` has expert e's rows ``[e*r, (e+1)*r)``; a B gradient ``[out, r*E]`` its columns
    ``j*E + e``: the blocks of experts (2, 0, 5) hold exactly those, in that order."""
    experts, rank, other = 6, 3, 5
    shape = (other, rank * experts) if which % 2 else (rank * experts, other)
    grad = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    index = torch.tensor([2, 0, 5])
    expected = torch.stack([grad[:, [j * experts + e for j in range(rank)]] if which % 2
                            else grad[e * rank:(e + 1) * rank] for e in index.tolist()], dim=2 if which % 2 else 0)
    assert tuple(expected.shape) == _grouped_shape(grad.shape, experts, which, 3)
    out = _select_blocks(grad, experts, which, index)
    assert torch.equal(out, expected)
    # Summed back through the same views, the blocks land where they came from
    total = torch.zeros(shape)
    _grouped(total, experts, which).index_add_(which % 2, index, _blocks_matrix(out, which))
    kept = torch.zeros(shape)
    for e in index.tolist():
        if which % 2:
            cols = [j * experts + e for j in range(rank)]
            kept[:, cols] = grad[:, cols]
        else:
            kept[e * rank:(e + 1) * rank] = grad[e * rank:(e + 1) * rank]
    assert torch.equal(total, kept)
