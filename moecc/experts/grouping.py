"""Routed (token, slot) pairs grouped by expert, for all of a layer's experts or a subset of them.

A grouping is ``offsets [E+1]`` and ``order [P]`` (int64): expert ``e`` owns the pair ids
``order[offsets[e]:offsets[e+1]]``, ascending; pair ``p`` is token ``p // k``, slot ``p % k``. For all experts
``P = T*k`` and ``order`` is a permutation; a subset keeps only its experts' pairs (the others own empty ranges),
so ``P`` is the subset's pair count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .. import _ops


@dataclass(frozen=True)
class Grouping:
    """Pair ids grouped by expert (see the module docstring)."""

    offsets: torch.Tensor  # [E+1] int64
    order: torch.Tensor  # [P] int64

    @property
    def num_experts(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_pairs(self) -> int:
        return self.order.numel()

    def counts(self) -> torch.Tensor:
        """``[E]`` pairs per expert (on the grouping's device)."""
        return self.offsets.diff()

    def subset(self, expert_mask: torch.Tensor, num_pairs: int | None = None) -> Grouping:
        """The pairs of the experts where ``expert_mask`` (bool ``[E]``) is set, in the same order.

        On a GPU this syncs once with the host for the subset's size, unless the caller knows it (``num_pairs``:
        the kept experts' pairs, from counts it holds on the host); the offsets stay on the device."""
        mask = expert_mask.to(device=self.offsets.device, dtype=torch.bool)
        if mask.shape != (self.num_experts,):
            raise ValueError(f"expert_mask must be bool [{self.num_experts}], got shape {tuple(expert_mask.shape)}")
        counts = self.counts() * mask  # [E]
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        if self.offsets.device.type == "cpu":  # the kept experts' slices (repeat_interleave is slow on the CPU)
            bounds = self.offsets.tolist()
            kept = [self.order[bounds[e]:bounds[e + 1]] for e in mask.nonzero().view(-1).tolist()]
            order = torch.cat(kept) if kept else self.order[:0]
            if num_pairs is not None and order.numel() != num_pairs:
                raise ValueError(f"the kept experts have {order.numel()} pairs, not num_pairs={num_pairs}")
            return Grouping(offsets, order)
        if num_pairs is None:
            keep = torch.repeat_interleave(mask, self.counts(), output_size=self.num_pairs)  # [P]
            return Grouping(offsets, self.order[keep])
        return Grouping(offsets, kept_pairs(self, offsets, num_pairs))


def kept_pairs(full: Grouping, offsets: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """``full.order``'s pairs of a subset whose offsets are ``offsets`` and size ``num_pairs``, with no host sync.
    Row j of the subset, of expert e, is row ``j - offsets[e] + full.offsets[e]`` of the full grouping: a gather
    of a size the caller gave, so the host does not wait for the device (and the expert copies queued before)."""
    device = full.offsets.device
    owner = torch.repeat_interleave(torch.arange(full.num_experts, device=device), offsets.diff(),
                                    output_size=num_pairs)
    rows = torch.arange(num_pairs, device=device) + (full.offsets[:-1] - offsets[:-1])[owner]
    return full.order[rows]


def group_by_expert(top_k_index: torch.Tensor, num_experts: int,
                    expert_mask: torch.Tensor | None = None, num_pairs: int | None = None) -> Grouping:
    """The stable grouping of ``top_k_index [T, k]``'s pairs by expert, of the experts in ``expert_mask`` only
    when one is given (``num_pairs``: their pairs, where the caller knows them: ``Grouping.subset``). In host
    memory the native counting sort (which checks every id); on a GPU a stable sort and a binary search, with no
    host sync (ids are trusted there: checking them would need one)."""
    if top_k_index.device.type == "cpu":
        if expert_mask is not None and expert_mask.device.type == "cpu" and expert_mask.dtype == torch.bool \
                and tuple(expert_mask.shape) == (num_experts,):  # one native pass over the kept pairs
            grouping = Grouping(*_ops.group_tokens_by_expert(top_k_index, num_experts, expert_mask))
            if num_pairs is not None and grouping.num_pairs != num_pairs:
                raise ValueError(f"the kept experts have {grouping.num_pairs} pairs, not num_pairs={num_pairs}")
            return grouping
        grouping = Grouping(*_ops.group_tokens_by_expert(top_k_index, num_experts))
    else:
        grouping = _sort_grouping(top_k_index, num_experts)
    return grouping if expert_mask is None else grouping.subset(expert_mask, num_pairs)


def _sort_grouping(top_k_index: torch.Tensor, num_experts: int) -> Grouping:
    """The same grouping from a stable sort and a binary search (no bincount, whose output size needs a sync)."""
    keys, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(num_experts + 1, dtype=keys.dtype, device=keys.device)
    return Grouping(torch.searchsorted(keys, bounds), order)


def resolve(top_k_index: torch.Tensor, num_experts: int, expert_mask: torch.Tensor | None,
            grouping: Grouping | None) -> Grouping:
    """The grouping a backend computes: ``grouping`` when given, else the one of ``expert_mask`` (all experts
    without one)."""
    if grouping is not None:
        if expert_mask is not None:
            raise ValueError("pass expert_mask or grouping, not both (grouping.subset(mask) combines them)")
        if grouping.num_experts != num_experts:
            raise ValueError(f"the grouping is of {grouping.num_experts} experts, the layer has {num_experts}")
        return grouping
    return group_by_expert(top_k_index, num_experts, expert_mask)


def is_full(grouping: Grouping, top_k_index: torch.Tensor) -> bool:
    """Whether the grouping covers every routed pair (no subset)."""
    return grouping.num_pairs == top_k_index.numel()


def kept_rows(offsets: torch.Tensor, experts: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the grouped rows of ``experts`` [P'] int64, in order, and the offsets [E+1] of those rows alone): how a
    saved state keeps only some of its experts (host offsets)."""
    bounds = offsets.tolist()
    keep = sorted(set(experts))
    if any(not 0 <= e < len(bounds) - 1 for e in keep):
        raise ValueError(f"experts {keep} are not all among the grouping's {len(bounds) - 1}")
    rows = [torch.arange(bounds[e], bounds[e + 1], dtype=torch.int64) for e in keep]
    counts = torch.zeros(len(bounds) - 1, dtype=torch.int64)
    for e in keep:
        counts[e] = bounds[e + 1] - bounds[e]
    new_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)), new_offsets
