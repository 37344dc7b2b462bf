"""Hybrid's CPU part: the worker's jobs, where their results land, and their sums with the GPU part's.

A CPU part either hands its results back to the caller, who waits for it and reads them in place from staging
buffers (``StagingBuffers.read_on_device``), or writes them into staging views taken beforehand and publishes a
number the device waits on itself (``CpuDone``), the caller going on (``_publish_target``,
``_backward_publish_target``). Either way the GPU part's results and the CPU part's sum on the device: the output
(``_add_part``), and in backward the input gradient, the routing-weight gradient and the LoRA gradients, of which
only the CPU experts' blocks cross (``_add``).
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
from torch.profiler import record_function

from ..experts import LoraGrads, SavedState
from ..experts.types import PairGrads
from ..experts.native import rows_pay
from ..lora import lora_tensors
from ..staging import StagingBuffers
from .base import current_graph_task

# Annotations name HybridEngine, HybridLayer and _Parts of moecc.paradigms.hybrid, which imports this module; they
# are never evaluated (``from __future__ import annotations``).

def _add_part(out: torch.Tensor, part: torch.Tensor, tokens: torch.Tensor | None,
              weights: torch.Tensor | None = None) -> None:
    """``out += part`` in place: a dense ``[T, H]`` part, or rows with their ``tokens`` (``out[tokens[p]] +=
    part[p]``, summed in float32 and rounded once into ``out``); ``weights [P]``: bf16 rows before their routing
    weights, each weighted in float32 first (the product the CPU would have made)."""
    if tokens is None:
        out.add_(part)
    else:
        rows = part if weights is None else part.float() * weights.unsqueeze(1)
        out.copy_(out.float().index_add_(0, tokens, rows))


def _mask(experts: Iterable[int], num_experts: int, staging: StagingBuffers | None = None) -> torch.Tensor:
    """The bool ``[E]`` mask of ``experts``: in host memory, or on ``staging``'s device (read in place, so it
    does not wait behind the weight copies queued on the copy engine)."""
    mask = torch.zeros(num_experts, dtype=torch.uint8)
    mask[list(experts)] = 1
    if staging is None:
        return mask.bool()
    return staging.read_on_device({"gpu_mask": mask}, lambda gpu_mask: gpu_mask != 0)


def _fresh_bytes(engine: HybridEngine) -> int:
    """The CPU backend's new buffer bytes so far (``NativeExperts.fresh_bytes``; 0 for a backend without pools)."""
    return getattr(engine.cpu, "fresh_bytes", 0)


def _cpu_forward(engine: HybridEngine, layer: HybridLayer, staged, weights, lora: tuple, lora_ready,
                 cpu: tuple[int, ...], counts: list[int], into: tuple | None = None):
    """(out or rows, their tokens or None, saved) of the CPU experts; ``into``: staging views (rows, tokens,
    weights) the backend writes the rows into itself (``forward_pairs_into``), which come back."""
    views = staged.wait()
    if lora_ready is not None:
        lora_ready.synchronize()
    began_ns, start, fresh = time.time_ns(), time.perf_counter(), _fresh_bytes(engine)
    args = (weights, views["hidden"], views["top_k_index"], views["top_k_weights"], *lora)
    with record_function("moecc.hybrid.cpu_forward"):
        if into is not None:
            out, tokens, row_weights = into
            saved = engine.cpu.forward_pairs_into(*args, expert_mask=_mask(cpu, weights.num_experts), rows=out,
                                                  tokens=tokens, weights_out=row_weights)
        elif hasattr(engine.cpu, "forward_pairs"):  # rows per pair, summed on the device
            out, tokens, saved = engine.cpu.forward_pairs(*args, expert_mask=_mask(cpu, weights.num_experts))
        else:
            (out, saved), tokens = engine.cpu.forward(*args, expert_mask=_mask(cpu, weights.num_experts)), None
    engine.record_cpu("forward", layer.index, [counts[e] for e in cpu], time.perf_counter() - start, began_ns,
                      cold=_fresh_bytes(engine) != fresh)
    return out, tokens, saved


def _may_publish(engine: HybridEngine, layer: HybridLayer, factors: Iterable[torch.Tensor | None],
                 backward: bool = False) -> bool:
    """Whether a CPU part of ``layer`` may publish its results for the device to wait on. Not in the first forward
    pass, nor in a backward before one backward pass has run in an earlier step: by then every kernel a step
    launches, JIT-compiled ones too, has been loaded once, and none loads behind a pending wait. The backend must
    return rows for the layer (the reference never does), the device must be CUDA with a working stream wait (or
    the CPU, where the wait blocks the host), and the LoRA factors on the engine's device (host factors are summed
    on the host, after the part)."""
    device_wait = engine.cpu_done.on_device and engine.staging.mapped
    returns_rows = getattr(engine.cpu, "returns_rows", None)
    loaded = (engine.first_backward_pass is not None and engine.first_backward_pass < engine.forward_passes
              if backward else engine.forward_passes >= 2)
    return (loaded and returns_rows is not None and returns_rows(layer.weights)
            and (device_wait or engine.device.type == "cpu")
            and all(t is None or t.device == engine.device for t in factors))


def _publish_target(engine: HybridEngine, layer: HybridLayer, call, hidden: torch.Tensor,
                    top_k_index: torch.Tensor, counts: list[int], cpu: tuple[int, ...]) -> tuple | None:
    """(number, rows [P, H] bf16, tokens [P] int64, weights [P] float32) staging views the CPU part writes its
    rows, before their routing weights, into and then publishes, where the device can wait for that itself
    (``_may_publish``); None where the caller waits: also a recomputation, the last layer (nothing after it would
    join the part) and a part whose results leave dense (``rows_pay``)."""
    if call.recompute or not _may_publish(engine, layer, ()):
        return None
    pairs = sum(counts[e] for e in cpu)
    if layer.index == len(engine.layers) - 1 or pairs >= top_k_index.numel() or not rows_pay(pairs,
                                                                                             hidden.shape[0]):
        return None
    rows = engine.staging.view("out", (pairs, hidden.shape[1]), torch.bfloat16)
    tokens = engine.staging.view("out_tokens", (pairs,), torch.int64)
    weights = engine.staging.view("out_weights", (pairs,), torch.float32)
    return engine.cpu_done.issue(), rows, tokens, weights


def _cpu_forward_published(published: tuple, engine: HybridEngine, *job):
    """:func:`_cpu_forward` whose backend writes its rows into the staging views of ``published`` itself
    (``forward_pairs_into``), then publishes its number (also when it fails, so no stream waits for ever; the error
    reaches the next layer call's join)."""
    number, *views = published
    try:
        return _cpu_forward(engine, *job, into=tuple(views))[2]
    except BaseException:
        for view in views:  # what the device reads must stay in bounds: an index past the output would break it
            view.zero_()
        raise
    finally:
        engine.cpu_done.publish(number)


def _cpu_backward(engine: HybridEngine, index: int, parts: _Parts, saved: SavedState, staged, counts: list[int],
                  kept: tuple[int, ...] | None = None, into: PairGrads | None = None):
    """The backward of a forward's CPU part; of its ``kept`` experts alone where given (the others' backward
    moved to the GPU). ``into``: where the backend writes the results itself (``backward_pairs_into``; None
    comes back)."""
    if kept is not None:
        saved = engine.cpu.keep_experts(parts.weights_host, saved, kept)
    views = staged.wait()
    began_ns, start, fresh = time.time_ns(), time.perf_counter(), _fresh_bytes(engine)
    args = (parts.weights_host, saved, views["grad_out"], *parts.cpu_lora)
    with record_function("moecc.hybrid.cpu_backward"):
        if into is not None:
            result = engine.cpu.backward_pairs_into(*args, out=into)
        elif hasattr(engine.cpu, "backward_pairs"):  # (grad rows, their tokens, ...), summed on the device
            result = engine.cpu.backward_pairs(*args)
        else:
            grad_hidden, grad_weights, grads = engine.cpu.backward(*args)
            result = grad_hidden, None, grad_weights, grads
    engine.record_cpu("backward", index, counts, time.perf_counter() - start, began_ns,
                      cold=_fresh_bytes(engine) != fresh)
    return result


def _backward_publish_target(engine: HybridEngine, layer: HybridLayer, parts: _Parts, grad_out: torch.Tensor,
                             weights_shape: torch.Size, counts: list[int],
                             cpu_experts: tuple[int, ...]) -> tuple | None:
    """(number, bank, staging views by role) the backward's CPU part writes its results into (the backend's
    ``backward_pairs_into``) and then publishes, where the device can wait for that itself (``_may_publish``, and
    rows per pair: ``rows_pay``); None where the caller waits. The views: the input gradient's rows and their
    tokens, the routing-weight gradient, the ids of the ``cpu_experts`` (whose ``counts`` these are) and, per LoRA
    factor, those experts' blocks of its gradient (``_grouped_shape``). Layers alternate between two banks of
    roles, so the next layer's views are not ones the device may still read."""
    factors = lora_tensors(parts.lora)
    pairs = sum(counts)
    if (current_graph_task() == -1 or not hasattr(engine.cpu, "backward_pairs_into")
            or not _may_publish(engine, layer, factors, backward=True)
            or pairs >= weights_shape.numel() or not rows_pay(pairs, grad_out.shape[0])):
        return None
    bank = f"backward{layer.index % 2}_"
    staging, num_experts, cpu = engine.staging, layer.weights.num_experts, len(cpu_experts)
    shapes = {"grad_hidden": ((pairs, grad_out.shape[1]), torch.bfloat16), "grad_tokens": ((pairs,), torch.int64),
              "grad_weights": (tuple(weights_shape), torch.float32), "lora_index": ((cpu,), torch.int64)}
    for which, factor in enumerate(factors):
        if factor is not None:
            shapes[f"lora_blocks{which}"] = (_grouped_shape(factor.shape, num_experts, which, cpu), torch.float32)
    views = {bank + role: staging.view(bank + role, shape, dtype) for role, (shape, dtype) in shapes.items()}
    views[bank + "lora_index"].copy_(torch.tensor(cpu_experts, dtype=torch.int64))
    return engine.cpu_done.issue(), bank, views


def _cpu_backward_published(published: tuple, engine: HybridEngine, *job):
    """:func:`_cpu_backward` whose backend writes its results into the staging views of ``published`` itself
    (``backward_pairs_into``), then publishes its number (also when it fails, so no stream waits for ever; the
    error reaches the join)."""
    number, bank, views = published
    try:
        _cpu_backward(engine, *job, into=_pair_grads(views, bank))
    except BaseException:
        for view in views.values():  # in bounds for the device: tokens and expert ids 0, with zero rows and blocks
            view.zero_()
        raise
    finally:
        engine.cpu_done.publish(number)


def _pair_grads(views: dict[str, torch.Tensor], bank: str) -> PairGrads:
    """The staging views of ``_backward_publish_target`` as the outputs of ``backward_pairs_into``."""
    return PairGrads(views[bank + "grad_hidden"], views[bank + "grad_tokens"], views[bank + "grad_weights"],
                     views[bank + "lora_index"], tuple(views.get(bank + f"lora_blocks{which}") for which in range(4)))


def _lora_grad_list(grads: LoraGrads) -> tuple:
    """The four LoRA gradients in ``lora_tensors`` order (gate_up A, B, down A, B)."""
    return grads.gate_up_A, grads.gate_up_B, grads.down_A, grads.down_B


def _expert_dim(which: int) -> int:
    """The experts' dimension of LoRA factor ``which``'s gradient viewed by :func:`_grouped`."""
    return which % 2


def _grouped_shape(shape: torch.Size, experts: int, which: int, count: int) -> tuple[int, int, int]:
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
    """Blocks of ``_grouped_shape`` as :func:`_grouped` lays out their factor (a view: ``out=`` writes through)."""
    return blocks.view(-1, blocks.shape[2]) if which % 2 else blocks.view(blocks.shape[0], -1)


def _select_blocks(grad: torch.Tensor, experts: int, which: int, index: torch.Tensor) -> torch.Tensor:
    """The blocks of the ``index`` experts of factor ``which``'s gradient, ``_grouped_shape`` long."""
    out = grad.new_empty(_grouped_shape(grad.shape, experts, which, index.numel()))
    torch.index_select(_grouped(grad, experts, which), _expert_dim(which), index, out=_blocks_matrix(out, which))
    return out


def _cpu_sources(grad_hidden: torch.Tensor, tokens: torch.Tensor | None, grad_weights: torch.Tensor,
                 grads: LoraGrads, cpu_experts: tuple[int, ...], lora: tuple) -> dict[str, torch.Tensor]:
    """The CPU part's host results by role, as ``_add`` reads them. Its LoRA gradients only as the blocks of
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


def _add(staging: StagingBuffers, gpu: tuple | None, sources: dict[str, torch.Tensor], bank: str, lora: tuple,
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
