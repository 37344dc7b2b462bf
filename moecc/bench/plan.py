"""Predicts the training-step time of each paradigm from rates measured on this machine (``rates.py``).

With T tokens per step, each MoE layer, forward then backward:
  co-compute  the GPU runs the layer's attention, router and the like (``a``, timed with the experts left out),
              the routed activations go to the host, the CPU runs the experts (our kernels, timed on this
              layer's shape) and the results come back; within a layer nothing overlaps:
                  a + cpu forward + cpu backward + activation bytes / PCIe rate
  offload     the experts are copied on their own stream while the GPU works on the layer before, so a pass
              costs max(copy, g + a/2), ``g`` the GPU's expert math (timed on this shape). Forward prefetches all
              of the next layer's experts once most are routed (its routing is not known yet; otherwise each
              copy waits for its router), backward the routed ones (uniform-routing estimate) and the layer's parked
              activations; the first forward copy is exposed, and the last ``offload_slots`` layers are still on the
              GPU for backward
  hybrid      per layer pass, the split ``moecc.paradigms.hybrid_split.plan_split`` picks for uniform routing:
              the GPU's experts stream over the link while the CPU computes the rest in place, so a pass costs
              max(a/2 + the slower side's experts, link); the CPU slowed by sharing DRAM with the copies, and the
              link by sharing it with the CPU. Its step guard runs every expert on the GPU where that is faster,
              so never above offload
  gpu         everything on the GPU: a timed training step of one MoE layer.
Where co-compute's own steps were timed (models of one and three MoE layers), its prediction is those per-layer
and rest-of-step times instead of the sum of its parts above, which timed apart overstate the step.
Once per step comes the rest (embeddings, dense layers, LM head, loss, the optimizer on the GPU), timed, and for
co-compute and offload the AdamW step over the expert LoRA factors, which live in host memory. Timings are
interpolated linearly in T between the token counts they were taken at, and kept above the floors the rates set
(the CPU reads every routed expert's weights from DRAM in each pass; the GPU cannot beat its matmul rate).
Without GPU rates (no GPU) only co-compute is predicted, everything on the CPU, its non-expert work estimated from
FLOPs; GPU parts that could not be timed are estimated from FLOPs as well.
"""
from __future__ import annotations

from bisect import bisect_left

from ..paradigms.hybrid_split import SideCosts, Split, plan_split
from .presets import PRESETS, preset_config
from .shapes import RANK, SEQUENCE, moe_shape, shape_key

BF16 = 2  # bytes per weight and activation


def _at(tokens: int, counts: list[int], seconds: list[float]) -> float:
    """``seconds`` timed at ``counts`` tokens: linear in between, extended by the end segments, never negative."""
    if len(counts) == 1:
        return seconds[0] * tokens / counts[0]
    j = min(max(bisect_left(counts, tokens), 1), len(counts) - 1)
    (t0, t1), (s0, s1) = counts[j - 1 : j + 1], seconds[j - 1 : j + 1]
    return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))


def _lora_factor(s: dict, rank: int) -> float:
    """Expert FLOPs with factorised LoRA of ``rank`` over those without: r·(2H + 3I) / (3·H·I) more."""
    return 1 + rank * (2 * s["hidden"] + 3 * s["inter"]) / (3 * s["hidden"] * s["inter"])


def _expert_bytes(s: dict) -> int:
    """One expert's bf16 weights: gate, up and down, 3·H·I values."""
    return 3 * s["hidden"] * s["inter"] * BF16


def _routed_experts(s: dict, tokens: int) -> float:
    """Experts one layer routes to, expected under uniform routing (each token picks k distinct experts)."""
    return s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** tokens)


def _expert_flops(s: dict, tokens: int, rank: int) -> float:
    """One pass over one layer's routed experts: 6·T·k·H·I with LoRA (backward needs as many for input grads)."""
    return 6 * tokens * s["top_k"] * s["hidden"] * s["inter"] * _lora_factor(s, rank)


def _nonexpert_flops(s: dict, tokens: int) -> tuple[float, float]:
    """(per MoE layer, rest of the step) FLOPs of a LoRA step outside the routed experts: a frozen weight costs
    its forward and input gradient, 4 FLOPs per weight and token; causal attention about 6·T·seq·heads·head_dim."""
    seq = min(tokens, SEQUENCE)
    attention = (4 * tokens * s["hidden"] * s["head_dim"] * 2 * (s["heads"] + s["kv_heads"])
                 + 6 * tokens * seq * s["heads"] * s["head_dim"])
    layer = attention + 4 * tokens * s["hidden"] * (s["experts"] + 3 * s["shared_inter"])
    dense = attention + 12 * tokens * s["hidden"] * s["dense_inter"]
    return layer, s["dense_layers"] * dense + 4 * tokens * s["vocab"] * s["hidden"]


def _cpu_experts_s(s: dict, tokens: int, rates: dict, timed: dict, rank: int) -> float:
    """One MoE layer's routed experts on the CPU, forward + backward: timed (scaled to ``rank``), and in each
    pass at least the time to read the routed experts' weights from DRAM."""
    scale = _lora_factor(s, rank) / _lora_factor(s, RANK)
    floor = _routed_experts(s, tokens) * _expert_bytes(s) / (rates["dram_gbps"] * 1e9)
    return sum(max(scale * _at(tokens, timed["tokens"], timed[f"cpu_{p}_s"]), floor) for p in ("forward", "backward"))


def _expert_lora_params(s: dict, rank: int) -> int:
    """Expert LoRA factor values of the model, r·E·(2H + 3I) per MoE layer."""
    return s["moe_layers"] * rank * s["experts"] * (2 * s["hidden"] + 3 * s["inter"])


def _host_optimizer_s(s: dict, rates: dict, rank: int) -> float:
    """AdamW over the expert LoRA factors in host memory."""
    return _expert_lora_params(s, rank) * rates["host_optimizer_ns_per_param"] * 1e-9


def _host_lora_copies_s(s: dict, rates: dict, rank: int) -> float:
    """Offload with the expert LoRA in host memory: the float32 factors go to the device once per forward pass
    and their gradients come back in backward."""
    nbytes = 4 * _expert_lora_params(s, rank)
    return nbytes / (rates["h2d_gbps"] * 1e9) + nbytes / (rates["d2h_gbps"] * 1e9)


def _activations_s(s: dict, tokens: int, rates: dict) -> float:
    """One co-compute layer's PCIe traffic. Down: hidden states, routing (int64 index, float32 weight per pair),
    the output gradient. Up: the output, the input gradient, the routing weights' gradient."""
    states, pairs = 2 * tokens * s["hidden"] * BF16, tokens * s["top_k"]
    return (states + 12 * pairs) / (rates["d2h_gbps"] * 1e9) + (states + 4 * pairs) / (rates["h2d_gbps"] * 1e9)


def _gpu_nonexpert_s(s: dict, tokens: int, rates: dict, timed: dict) -> tuple[float, float]:
    """(per MoE layer, rest of the step) seconds of the GPU's work outside the routed experts."""
    if "gpu_attention_layer_s" in timed:
        counts = timed["gpu_tokens"]
        return _at(tokens, counts, timed["gpu_attention_layer_s"]), _at(tokens, counts, timed["gpu_attention_rest_s"])
    layer, rest = _nonexpert_flops(s, tokens)
    return layer / (rates["gpu_tflops"] * 1e12), rest / (rates["gpu_tflops"] * 1e12)


def _gpu_experts_s(s: dict, tokens: int, rates: dict, timed: dict, rank: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's routed experts on the GPU under offload (weights there)."""
    flops_s = _expert_flops(s, tokens, rank) / (rates["gpu_tflops"] * 1e12)
    if "gpu_experts_forward_s" not in timed:
        return flops_s, flops_s
    scale = _lora_factor(s, rank) / _lora_factor(s, RANK)
    forward, backward = (max(scale * _at(tokens, timed["gpu_tokens"], timed[f"gpu_experts_{p}_s"]), flops_s)
                         for p in ("forward", "backward"))
    return forward, backward


def _offload_layers_s(s: dict, tokens: int, rates: dict, attention: float, forward: float, backward: float,
                      slots: int, recomputed: bool = False) -> float:
    """The MoE layers under offload, copies overlapped with compute as the module docstring says; ``slots``
    layers' experts fit on the GPU at once. ``recomputed``: each layer's backward first runs its expert math
    forward again (``_recomputes_experts``), beside the copies of the layers before; its backward still uses
    the first forward's parked state."""
    layers = s["moe_layers"]
    if layers == 0:
        return 0.0
    expert_s = _expert_bytes(s) / (rates["h2d_gbps"] * 1e9)
    routed = _routed_experts(s, tokens)
    copy_routed, copy_all = routed * expert_s, s["experts"] * expert_s
    gpu_forward = forward + attention / 2
    gpu_backward = backward + attention / 2 + (forward if recomputed else 0.0)
    if 2 * routed >= s["experts"]:  # the next layer's experts, all of them, are copied during this one
        forward_s = copy_routed + gpu_forward + (layers - 1) * max(copy_all, gpu_forward)
    else:
        forward_s = layers * (copy_routed + gpu_forward)
    resident = min(slots, layers)
    # Backward also brings each layer's parked state back on the same stream (its forward sent it the other way,
    # on a stream of its own: PCIe is full duplex).
    parked_s = _parked_bytes(s, tokens) / (rates["h2d_gbps"] * 1e9)
    # The resident layers' weights need no copy, but their parked state does, with little to hide behind.
    return (forward_s + resident * (gpu_backward + parked_s)
            + (layers - resident) * max(copy_routed + parked_s, gpu_backward))


# Hybrid's CPU part: a fixed cost per layer pass (staging, gathers, scatters) and the kernels' slowdown with two
# cores left to the copies while PCIe streams; the engine measures both as it runs.
HYBRID_CPU_CALL_S = 5e-3
HYBRID_CPU_SLOWDOWN = 1.1
# The link's share of offload's rate while the CPU part reads DRAM beside it: the two compete for memory.
HYBRID_LINK_SHARE = 0.94


def _hybrid_costs(s: dict, tokens: int, rates: dict, timed: dict, rank: int, phase: str, gpu_s: float,
                  serial_s: float, parked_s: float) -> SideCosts:
    """One MoE layer's ``phase`` pass under hybrid, routing uniform: the CPU's timed pass cut into a per-expert
    part (its DRAM floor: reading the weights) and a per-pair part; the link carries each GPU expert's weights
    and its share of ``parked_s`` (the GPU part's saved state coming back in backward); the GPU's timed pass is
    per pair, after ``serial_s`` (the layer's attention share)."""
    routed = max(1, round(_routed_experts(s, tokens)))
    pairs = tokens * s["top_k"]
    scale = _lora_factor(s, rank) / _lora_factor(s, RANK)
    cpu_pass = HYBRID_CPU_SLOWDOWN * scale * _at(tokens, timed["tokens"], timed[f"cpu_{phase}_s"])
    weights_s = _expert_bytes(s) / (rates["dram_gbps"] * 1e9)
    cpu_pass = max(cpu_pass, routed * weights_s)
    link_s = _expert_bytes(s) / (HYBRID_LINK_SHARE * rates["h2d_gbps"] * 1e9)
    return SideCosts(cpu_expert_s=weights_s, cpu_token_s=(cpu_pass - routed * weights_s) / pairs,
                     copy_expert_s=link_s + parked_s / routed, gpu_expert_s=0.0, gpu_token_s=gpu_s / pairs,
                     cpu_call_s=HYBRID_CPU_CALL_S, serial_s=serial_s)


def hybrid_splits(s: dict, tokens: int, rates: dict, timed: dict, rank: int, gpu_forward_s: float,
                  gpu_backward_s: float, attention: float = 0.0) -> tuple[Split, Split]:
    """The (forward, backward) of one MoE layer under hybrid, routing uniform, as the engine plans them: per
    pass the busier of (the GPU's ``attention`` share, then the slower side's experts) and the link, which streams
    the next layer's GPU experts all the while (and in backward the GPU part's parked state); the backward runs
    its forward's GPU experts again (copying them again) and may take some of its CPU experts too."""
    routed = max(1, round(_routed_experts(s, tokens)))
    counts = [tokens * s["top_k"] / routed] * routed
    parked_s = _parked_bytes(s, tokens) / (HYBRID_LINK_SHARE * rates["h2d_gbps"] * 1e9)
    forward = _hybrid_costs(s, tokens, rates, timed, rank, "forward", gpu_forward_s, attention / 2, 0.0)
    backward = _hybrid_costs(s, tokens, rates, timed, rank, "backward", gpu_backward_s, attention / 2, parked_s)
    split = plan_split(counts, forward, then=backward)
    return split, plan_split(counts, backward, required=split.gpu, recompute=forward)


def _hybrid_layers_s(s: dict, tokens: int, rates: dict, timed: dict, rank: int, attention: float,
                     forward: float, backward: float) -> float:
    """The MoE layers under hybrid: each layer's two passes as ``hybrid_splits`` prices them."""
    splits = hybrid_splits(s, tokens, rates, timed, rank, forward, backward, attention)
    return s["moe_layers"] * sum(split.predicted_s for split in splits)


def _parked_bytes(s: dict, tokens: int) -> int:
    """One offloaded layer's saved state, parked in host memory: the hidden states, and per (token, expert) pair
    its routing weight (float32), grouping indices (int64) and gate/up output (2I bf16); 29 KB per token for
    Qwen3-30B-A3B."""
    pairs = tokens * s["top_k"]
    return tokens * s["hidden"] * BF16 + pairs * (4 + 8 + 2 * s["inter"] * BF16)


def _gpu_paradigm_s(s: dict, tokens: int, rates: dict, timed: dict, rank: int) -> float:
    if "gpu_layer_s" in timed:
        # before rates v8 the whole model shared the other GPU timings' token list
        counts = timed["gpu_layer_tokens"] if "gpu_layer_tokens" in timed else timed["gpu_tokens"]
        return s["moe_layers"] * _at(tokens, counts, timed["gpu_layer_s"]) + _at(tokens, counts, timed["gpu_rest_s"])
    attention, rest = _gpu_nonexpert_s(s, tokens, rates, timed)
    experts = 2 * _expert_flops(s, tokens, rank) / (rates["gpu_tflops"] * 1e12)
    return s["moe_layers"] * (attention + experts) + rest


def _cocompute_in_place_s(s: dict, tokens: int, rates: dict, timed: dict, rank: int, recomputed: float) -> float:
    """Co-compute from its timed steps: per MoE layer (timed at rank ``RANK``; for another rank its share of the
    host optimizer is replaced by ``rank``'s and the rest scaled by the experts' LoRA FLOP ratio, which slightly
    overstates the change for the attention part of the layer), plus ``recomputed`` per layer (the non-expert
    forward again under checkpointing), plus the rest of the step."""
    counts = timed.get("cocompute_tokens", timed["tokens"])
    per_layer_optimizer = {r: _host_optimizer_s(s, rates, r) / max(1, s["moe_layers"]) for r in (RANK, rank)}
    layer = max(0.0, _at(tokens, counts, timed["cocompute_layer_s"]) - per_layer_optimizer[RANK])
    layer = layer * _lora_factor(s, rank) / _lora_factor(s, RANK) + per_layer_optimizer[rank]
    return s["moe_layers"] * (layer + recomputed) + _at(tokens, counts, timed["cocompute_rest_s"])


def _shape_timings(rates: dict, preset: str) -> dict | None:
    """``preset``'s shape rates from ``rates["shapes"]``; rates that can measure (``rates.MachineRates``) time a
    shape they lack first, so a plain dict of rates keeps this module free of measurement."""
    measure = getattr(rates, "shape_rates", None)
    if measure is not None:
        return measure(preset)
    return rates.get("shapes", {}).get(shape_key(moe_shape(preset_config(preset))))


def _recomputes_experts(s: dict, checkpointing: bool) -> bool:
    """Whether Hugging Face's non-reentrant checkpointing runs a layer's routed experts again in backward. Its
    recomputation stops at the layer's last saved tensor, and the experts' autograd nodes save none: only a
    shared expert after them (Qwen2-MoE, DeepSeek) carries it through the routed experts. Their backward uses
    the first forward's state either way, so a checkpointed backward brings back every byte the forward
    parked."""
    return checkpointing and s["shared_inter"] > 0


# With gradient checkpointing every layer's forward runs again before its backward: about a third more GPU
# work for the layers (a forward is about a third of forward + backward).
RECOMPUTE = 1 / 3


def predict(preset: str, tokens: int, rates: dict, layers: int | None = None, rank: int = RANK,
            checkpointing: bool = False, offload_lora_on_device: bool = True,
            offload_slots: int = 2) -> dict[str, float]:
    """Predicted seconds per training step of ``tokens`` tokens for ``cocompute``, ``offload``, ``hybrid`` and ``gpu`` (only
    ``cocompute``, all on the CPU, without GPU rates), with LoRA of ``rank`` on attention and experts.

    ``rates``: from :func:`moecc.bench.rates.measure` (which times a preset's shape when it is first predicted),
    or a dict of the same form that already holds the preset's shape rates. ``checkpointing``: Hugging Face
    gradient checkpointing (non-reentrant): the GPU recomputes each layer's attention, and the routed experts
    only where a shared expert after them carries the recomputation through them (``_recomputes_experts``);
    co-compute replays the CPU experts' first result, so their time does not grow.
    ``offload_lora_on_device``: offload keeps the expert LoRA on the GPU (``MoeccConfig.offload_lora``), where
    the optimizer steps it in no time worth counting; otherwise it pays the host optimizer as co-compute does,
    and the factors' copies each way. ``offload_slots``: ``MoeccConfig.offload_slots`` of the engine predicted.
    """
    s = moe_shape(preset_config(preset, layers))
    timed = _shape_timings(rates, preset)
    if timed is None:
        raise ValueError(f"the rates hold no timings of {preset}'s shape; take them from moecc.bench.rates.measure(), "
                         "which times a shape the first time it is predicted")
    cpu = _cpu_experts_s(s, tokens, rates, timed, rank)
    optimizer = _host_optimizer_s(s, rates, rank)
    if "h2d_gbps" not in rates:
        layer, rest = (flops / (rates["cpu_matmul_tflops"] * 1e12) for flops in _nonexpert_flops(s, tokens))
        if "cocompute_layer_s" in timed:  # timed in place, on the CPU
            recomputed = layer * (RECOMPUTE if checkpointing else 0.0)
            return {"cocompute": _cocompute_in_place_s(s, tokens, rates, timed, rank, recomputed)}
        return {"cocompute": s["moe_layers"] * (layer + cpu) + rest + optimizer}
    attention, rest = _gpu_nonexpert_s(s, tokens, rates, timed)
    forward, backward = _gpu_experts_s(s, tokens, rates, timed, rank)
    recompute = RECOMPUTE if checkpointing else 0.0
    attention *= 1 + recompute
    experts_again = _recomputes_experts(s, checkpointing)
    offload = _offload_layers_s(s, tokens, rates, attention, forward, backward, offload_slots, experts_again)
    cocompute = s["moe_layers"] * (attention + cpu + _activations_s(s, tokens, rates)) + rest + optimizer
    if "cocompute_layer_s" in timed:  # timed in place
        cocompute = _cocompute_in_place_s(s, tokens, rates, timed, rank, attention * recompute / (1 + recompute))
    lora_s = 0.0 if offload_lora_on_device else optimizer + _host_lora_copies_s(s, rates, rank)
    hybrid = _hybrid_layers_s(s, tokens, rates, timed, rank, attention, forward, backward)
    if experts_again:
        hybrid += s["moe_layers"] * forward
    return {
        "cocompute": cocompute,
        "offload": offload + rest + lora_s,
        "hybrid": min(hybrid, offload) + rest + lora_s,  # the step guard's steps with every expert on the GPU
        "gpu": _gpu_paradigm_s(s, tokens, rates, timed, rank) * (1 + recompute),
    }


# moecc bench's default batches: ``paradigm="auto"`` weighs a paradigm over all three
AUTO_TOKENS = (512, 2048, 8192)
AUTO_CHOICES = ("cocompute", "offload", "hybrid")  # simplest first
AUTO_MARGIN = 0.03  # a later choice must be predicted this much faster than an earlier one (run-to-run noise)


def auto_paradigm(config, rates: dict, offload_slots: int = 2) -> tuple[str, str] | None:
    """(the paradigm predicted fastest for a model of transformers ``config``'s shape and layers, one line why)
    from ``rates`` measured on this machine: the one whose step time, over ``AUTO_TOKENS``, is least above the best
    paradigm's at each, or a simpler one within ``AUTO_MARGIN`` of it. None where the rates hold no GPU rates or
    no timings of that shape (only presets' shapes are timed: ``moecc plan --preset NAME``)."""
    try:
        shape = moe_shape(config)
        key = shape_key(shape)
        if "h2d_gbps" not in rates or key not in rates.get("shapes", {}):
            return None
        preset = next((name for name in PRESETS if shape_key(moe_shape(preset_config(name))) == key), None)
        if preset is None:
            return None
        times = {tokens: predict(preset, tokens, rates, shape["layers"], offload_slots=offload_slots)
                 for tokens in AUTO_TOKENS}
    except Exception:  # not a MoE config (prepare refuses it with its own message), or rates it cannot read
        return None
    above = {p: sum(t[p] / min(t[q] for q in AUTO_CHOICES) for t in times.values()) for p in AUTO_CHOICES}
    choice = next(p for p in AUTO_CHOICES if above[p] <= min(above.values()) * (1 + AUTO_MARGIN))
    seconds = "; ".join(f"{p} " + " / ".join(f"{t[p]:.2f}" for t in times.values()) for p in AUTO_CHOICES)
    return choice, (f"predicted seconds per step at {' / '.join(map(str, AUTO_TOKENS))} tokens from this machine's "
                    f"measured rates ({preset}'s shape, {shape['layers']} layers): {seconds}")


def crossover(preset: str, rates: dict, layers: int | None = None, limit: int = 1 << 20,
              rank: int = RANK, offload_slots: int = 2) -> int | None:
    """The smallest power-of-two token count per step at which offload is predicted faster than co-compute."""
    tokens = 16
    while tokens <= limit:
        times = predict(preset, tokens, rates, layers, rank, offload_slots=offload_slots)
        if "offload" not in times:
            return None
        if times["offload"] < times["cocompute"]:
            return tokens
        tokens *= 2
    return None


def hybrid_plan(preset: str, tokens: int, rates: dict, layers: int | None = None, rank: int = RANK) -> dict:
    """The split hybrid is predicted to take at ``tokens`` tokens (uniform routing): GPU experts of the routed ones
    and the predicted CPU, link and GPU seconds, per pass of one MoE layer."""
    s = moe_shape(preset_config(preset, layers))
    timed = _shape_timings(rates, preset)
    if timed is None or "h2d_gbps" not in rates:
        return {}
    forward, backward = _gpu_experts_s(s, tokens, rates, timed, rank)
    attention = _gpu_nonexpert_s(s, tokens, rates, timed)[0]
    out = {}
    for phase, split in zip(("forward", "backward"),
                            hybrid_splits(s, tokens, rates, timed, rank, forward, backward, attention)):
        out[phase] = {"gpu_experts": len(split.gpu), "routed_experts": round(_routed_experts(s, tokens)),
                      "cpu_s": split.cpu_s, "link_s": split.copy_s, "gpu_s": split.gpu_s, "side": _side(split)}
    return out


def _side(split: Split) -> str:
    """``"cpu"``, ``"gpu"`` or ``"both"``: where a planned pass's work runs."""
    if not split.gpu:
        return "cpu"
    return "gpu" if split.cpu_s == 0.0 else "both"


def describe(preset: str, rates: dict) -> list[str]:
    """What was timed on ``preset``'s shape, ms per MoE layer (forward + backward) by tokens per step."""
    timed = _shape_timings(rates, preset) or {}
    parts = (("CPU experts (ours)", "tokens", ("cpu_forward_s", "cpu_backward_s")),
             ("GPU experts (offload)", "gpu_tokens", ("gpu_experts_forward_s", "gpu_experts_backward_s")),
             ("GPU rest of a layer", "gpu_tokens", ("gpu_attention_layer_s",)),
             ("GPU whole layer (gpu)", "gpu_layer_tokens", ("gpu_layer_s",)),
             ("co-compute layer in a step", "tokens", ("cocompute_layer_s",)))
    lines = []
    for label, counts, names in parts:
        if all(name in timed for name in names):
            if counts not in timed:  # before rates v8 the whole-layer timings shared the GPU token list
                counts = "gpu_tokens"
            times = [sum(timed[name][i] for name in names) for i in range(len(timed[counts]))]
            pairs = zip(timed[counts], times)
            lines.append(f"  {label}: " + ", ".join(f"{count} tokens {1e3 * s:.1f} ms" for count, s in pairs))
    return lines
