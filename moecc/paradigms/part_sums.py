"""Where hybrid's CPU part's results land on the device, and their sums with the GPU part's.

The output (``add_part``): a dense ``[T, H]`` part, or rows per pair added at their tokens. In backward
(``add_grads``): the input gradient, the routing-weight gradient and the LoRA gradients, of which only the CPU
experts' blocks cross. Sources are the CPU part's results by role: host tensors read in place
(``StagingBuffers.read_on_device``) or staging views the part filled itself (``read_views_on_device``).
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..experts import LoraGrads
from ..experts.types import PairGrads
from ..lora import lora_tensors
from ..staging import StagingBuffers


def add_part(out: torch.Tensor, part: torch.Tensor, tokens: torch.Tensor | None,
              weights: torch.Tensor | None = None) -> None:
    """``out += part`` in place: a dense ``[T, H]`` part, or rows with their ``tokens`` (``out[tokens[p]] +=
    part[p]``, summed in float32 and rounded once into ``out``); ``weights [P]``: bf16 rows before their routing
    weights, each weighted in float32 first (the product the CPU would have made)."""
    if tokens is None:
        out.add_(part)
    else:
        rows = part if weights is None else part.float() * weights.unsqueeze(1)
        out.copy_(out.float().index_add_(0, tokens, rows))


def expert_mask(experts: Iterable[int], num_experts: int, staging: StagingBuffers | None = None) -> torch.Tensor:
    """The bool ``[E]`` mask of ``experts``: in host memory, or on ``staging``'s device (read in place, so it
    does not wait behind the weight copies queued on the copy engine)."""
    mask = torch.zeros(num_experts, dtype=torch.uint8)
    mask[list(experts)] = 1
    if staging is None:
        return mask.bool()
    return staging.read_on_device({"gpu_mask": mask}, lambda gpu_mask: gpu_mask != 0)


def pair_grads(views: dict[str, torch.Tensor], bank: str) -> PairGrads:
    """The staging views of ``CpuPart.backward_target`` as the outputs of ``backward_pairs_into``."""
    return PairGrads(views[bank + "grad_hidden"], views[bank + "grad_tokens"], views[bank + "grad_weights"],
                     views[bank + "lora_index"], tuple(views.get(bank + f"lora_blocks{which}") for which in range(4)))


def _lora_grad_list(grads: LoraGrads) -> tuple:
    """The four LoRA gradients in ``lora_tensors`` order (gate_up A, B, down A, B)."""
    return grads.gate_up_A, grads.gate_up_B, grads.down_A, grads.down_B


def _expert_dim(which: int) -> int:
    """The experts' dimension of LoRA factor ``which``'s gradient viewed by :func:`_grouped`."""
    return which % 2


def grouped_shape(shape: torch.Size, experts: int, which: int, count: int) -> tuple[int, int, int]:
    """Factor ``which``'s gradient ``shape`` with its experts' dimension apart and ``count`` experts long: an A
    gradient ``[r*E, in]`` (rows ``[e*r, (e+1)*r)``) as ``[E, r, in]``, a B gradient ``[out, r*E]`` (columns
    ``j*E + e``) as ``[out, r, E]``."""
    if which % 2:
        return shape[0], shape[1] // experts, count
    return count, shape[0] // experts, shape[1]


def _grouped(grad: torch.Tensor, experts: int, which: int) -> torch.Tensor:
    """Factor ``which``'s gradient as a matrix with one row (A) or column (B) per expert: ``[E, r*in]`` or
    ``[out*r, E]``. Selecting B's experts from ``[out, r, E]`` took torch 8x as long as from this view."""
    return grad.view(-1, experts) if which % 2 else grad.view(experts, -1)


def _blocks_matrix(blocks: torch.Tensor, which: int) -> torch.Tensor:
    """Blocks of ``grouped_shape`` as :func:`_grouped` lays out their factor (a view: ``out=`` writes through)."""
    return blocks.view(-1, blocks.shape[2]) if which % 2 else blocks.view(blocks.shape[0], -1)


def _select_blocks(grad: torch.Tensor, experts: int, which: int, index: torch.Tensor) -> torch.Tensor:
    """The blocks of the ``index`` experts of factor ``which``'s gradient, ``grouped_shape`` long."""
    out = grad.new_empty(grouped_shape(grad.shape, experts, which, index.numel()))
    torch.index_select(_grouped(grad, experts, which), _expert_dim(which), index, out=_blocks_matrix(out, which))
    return out


def host_sources(grad_hidden: torch.Tensor, tokens: torch.Tensor | None, grad_weights: torch.Tensor,
                 grads: LoraGrads, cpu_experts: tuple[int, ...], lora: tuple) -> dict[str, torch.Tensor]:
    """The CPU part's host results by role, as ``add_grads`` reads them. Its LoRA gradients only as the blocks of
    ``cpu_experts`` (zero elsewhere; the whole tensors were ~25 MB of pageable copies per layer for Qwen3-30B-A3B,
    on the backward's critical path)."""
    sources = {"grad_hidden": grad_hidden, "grad_weights": grad_weights}  # the input gradient dense, or rows
    if tokens is not None:
        sources["grad_tokens"] = tokens
    index = sources["lora_index"] = torch.tensor(cpu_experts, dtype=torch.int64)
    for which, grad in enumerate(_lora_grad_list(grads)):
        if grad is not None:
            sources[f"lora_blocks{which}"] = _select_blocks(grad, lora[which // 2].num_experts, which, index)
    return sources


def add_grads(staging: StagingBuffers, gpu: tuple | None, sources: dict[str, torch.Tensor], bank: str, lora: tuple,
         like: torch.Tensor, weights_shape: torch.Size) -> tuple:
    """Both parts' (grad_hidden, grad_top_k_weights, LoraGrads) summed on the GPU part's device (float32), the
    LoRA gradients where their factors live. ``sources``: the CPU part's results by role (``bank`` + role): host
    tensors, read in place (``StagingBuffers.read_on_device``), or staging views the CPU part fills and publishes
    itself (``read_views_on_device``; ``_may_publish`` keeps every factor on the device then). Its LoRA gradients
    arrive as the blocks of the experts ``lora_index`` names."""
    factors = lora_tensors(lora)
    gpu_grads = (None,) * 4 if gpu is None else _lora_grad_list(gpu[2])
    totals = [None if f is None else (torch.zeros(f.shape, dtype=torch.float32, device=f.device) if g is None
                                      else g.to(f.device).contiguous())  # summed into in place through views
              for g, f in zip(gpu_grads, factors)]
    experts = [None if f is None else lora[which // 2].num_experts for which, f in enumerate(factors)]
    bases = ((torch.zeros(like.shape, dtype=torch.float32, device=like.device),
              torch.zeros(tuple(weights_shape), dtype=torch.float32, device=like.device)) if gpu is None
             else (gpu[0].float(), gpu[1].float()))

    def add_blocks(which: int, index: torch.Tensor, blocks: torch.Tensor) -> None:
        _grouped(totals[which], experts[which], which).index_add_(_expert_dim(which), index,
                                                                  _blocks_matrix(blocks.contiguous(), which))

    if staging.pinned:  # factors in host memory take their blocks there, before the device's read
        for which, factor in enumerate(factors):
            if factor is not None and factor.device.type == "cpu":
                add_blocks(which, sources[bank + "lora_index"], sources.pop(bank + f"lora_blocks{which}"))

    def consume(**views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        read = {role[len(bank):]: view for role, view in views.items()}
        for which in range(len(factors)):
            if f"lora_blocks{which}" in read:
                add_blocks(which, read["lora_index"], read[f"lora_blocks{which}"])
        hidden = (torch.add(bases[0], read["grad_hidden"]) if "grad_tokens" not in read  # rows (bf16) sum in fp32
                  else torch.index_add(bases[0], 0, read["grad_tokens"], read["grad_hidden"].to(bases[0].dtype)))
        return hidden, torch.add(bases[1], read["grad_weights"])

    read = staging.read_views_on_device if bank else staging.read_on_device
    hidden, weights = read(sources, consume)
    return hidden, weights, LoraGrads(*totals)
