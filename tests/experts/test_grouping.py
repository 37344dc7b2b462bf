"""Groupings of routed pairs by expert: the sync-free sort used off the CPU, and subsets of a grouping."""
from __future__ import annotations

import pytest
import torch

from moecc.experts import group_by_expert
from moecc.experts.grouping import _sort_grouping

EXPERTS, TOP_K = 6, 2


def _index(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not tokens:
        return torch.empty(0, TOP_K, dtype=torch.int64)
    return torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:TOP_K] for _ in range(tokens)])


@pytest.mark.parametrize("tokens", [0, 1, 40])
def test_device_grouping_matches_the_native_sort(tokens):
    """The sort and binary search used off the CPU give the native counting sort's offsets and stable order."""
    index = _index(tokens)
    got, want = _sort_grouping(index, EXPERTS), group_by_expert(index, EXPERTS)
    assert got.offsets.tolist() == want.offsets.tolist() and got.order.tolist() == want.order.tolist()


@pytest.mark.parametrize("tokens", [0, 1, 40])
def test_subset_keeps_its_experts_pairs_in_order(tokens):
    index = _index(tokens, seed=1)
    full = group_by_expert(index, EXPERTS)
    mask = torch.tensor([True, False, True, True, False, True])  # expert 5 has no pairs
    part = full.subset(mask)
    assert part.num_experts == EXPERTS and part.num_pairs == int(mask[index].sum())
    assert part.counts().tolist() == [c if m else 0 for c, m in zip(full.counts().tolist(), mask.tolist())]
    for expert in range(EXPERTS):
        pairs = part.order[part.offsets[expert]:part.offsets[expert + 1]].tolist()
        expected = full.order[full.offsets[expert]:full.offsets[expert + 1]].tolist() if mask[expert] else []
        assert pairs == expected
    assert group_by_expert(index, EXPERTS, mask).order.tolist() == part.order.tolist()
    with pytest.raises(ValueError, match=r"expert_mask must be bool \[6\]"):
        full.subset(torch.ones(5, dtype=torch.bool))
