"""Predicts the training-step time of each paradigm from measured rates and the model's shape.

Per MoE layer and pass (forward, then backward with the same input-side products):
  co-compute: the CPU reads every routed expert's weights once and does 6·T·k·H·I FLOPs, so its time is
              max(bytes / DRAM rate, FLOPs / CPU kernel rate), plus the activations' PCIe round trip;
  offload:    the routed experts' weights cross PCIe (again in backward), overlapped with the GPU's expert
              math, so max(bytes / H2D rate, FLOPs / GPU rate);
  gpu:        everything on the GPU at its matmul rate.
Everything else (attention, dense layers, LM head: 6·params·T FLOPs for a training step) runs on the GPU in
every paradigm. The estimates are first-order; ``moecc bench`` prints them next to measurements.
"""
from __future__ import annotations

from .presets import preset_config


def _shape(config) -> dict:
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or config.n_routed_experts)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    moe_layers = max(0, config.num_hidden_layers - dense)
    hidden = config.hidden_size
    expert_params = moe_layers * experts * 3 * hidden * inter
    attention = config.num_hidden_layers * 4 * hidden * hidden  # first-order: q, k, v, o
    embeddings = 2 * config.vocab_size * hidden
    return dict(experts=experts, top_k=config.num_experts_per_tok, hidden=hidden, inter=inter,
                moe_layers=moe_layers, expert_params=expert_params, other_params=attention + embeddings)


def predict(preset: str, tokens: int, rates: dict, layers: int | None = None) -> dict[str, float]:
    """Predicted seconds per training step for ``cocompute``, ``offload`` and ``gpu``.

    Without GPU rates (no GPU here) only ``cocompute`` is predicted, with everything on the CPU.
    """
    s = _shape(preset_config(preset, layers))
    pairs = tokens * s["top_k"]
    active = s["experts"] * (1 - (1 - 1 / s["experts"]) ** pairs)  # experts hit by uniform routing
    layer_bytes = active * 3 * s["hidden"] * s["inter"] * 2
    layer_flops = 6 * pairs * s["hidden"] * s["inter"]
    gpu_rate = rates.get("gpu_tflops", rates["cpu_expert_tflops"]) * 1e12
    other = 6 * s["other_params"] * tokens / gpu_rate
    activations = 2 * tokens * s["hidden"] * 2 * 2  # T x H bf16 each way, forward and backward
    h2d = rates.get("h2d_gbps", rates["dram_gbps"]) * 1e9
    cocompute = s["moe_layers"] * 2 * (
        max(layer_bytes / (rates["dram_gbps"] * 1e9), layer_flops / (rates["cpu_expert_tflops"] * 1e12))
        + activations / 2 / h2d)
    offload = s["moe_layers"] * 2 * max(layer_bytes / h2d, layer_flops / gpu_rate)
    if "gpu_tflops" not in rates:
        return {"cocompute": cocompute + other}
    return {"cocompute": cocompute + other, "offload": offload + other,
            "gpu": s["moe_layers"] * 2 * layer_flops / gpu_rate + other}


def crossover(preset: str, rates: dict, layers: int | None = None, limit: int = 1 << 20) -> int | None:
    """The smallest power-of-two token count per step at which offload is predicted faster than co-compute."""
    tokens = 16
    while tokens <= limit:
        times = predict(preset, tokens, rates, layers)
        if "offload" not in times:
            return None
        if times["offload"] < times["cocompute"]:
            return tokens
        tokens *= 2
    return None
