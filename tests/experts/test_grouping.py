"""Groupings of routed pairs by expert: the sync-free sort used off the CPU, and subsets of a grouping."""
from __future__ import annotations

import pytest
import torch

from moecc.experts import group_by_expert
from moecc.experts.grouping import _sort_grouping, kept_pairs

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


@pytest.mark.parametrize("tokens", [0, 1, 40])
@pytest.mark.parametrize("kept", [(), (0,), (0, 2, 3, 5), tuple(range(EXPERTS))])
def test_sized_subset_gathers_the_same_pairs(tokens, kept):
    """The subset of a size the caller gives (the GPU's path, no host sync) has the same pairs as the sized-by-
    sync one, and a size that does not match the kept experts' pairs is refused where it can be checked."""
    index = _index(tokens, seed=2)
    full = _sort_grouping(index, EXPERTS)
    mask = torch.zeros(EXPERTS, dtype=torch.bool)
    mask[list(kept)] = True
    want = full.subset(mask)
    counts = full.counts() * mask
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    assert kept_pairs(full, offsets, want.num_pairs).tolist() == want.order.tolist()
    assert full.subset(mask, want.num_pairs).order.tolist() == want.order.tolist()
    with pytest.raises(ValueError, match=rf"have {want.num_pairs} pairs, not num_pairs={want.num_pairs + 1}"):
        full.subset(mask, want.num_pairs + 1)
