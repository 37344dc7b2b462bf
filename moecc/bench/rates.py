"""Rates measured on this machine, which the planner predicts from; cached as JSON so ``moecc plan`` answers at
once after the first run.

Machine rates, measured once (a few seconds): host DRAM read GB/s, CPU bf16 matmul TFLOP/s, the host
optimizer's ns per parameter (AdamW in host memory, where co-compute and offload keep the expert LoRA factors),
and where there is a GPU: pinned PCIe H2D / D2H GB/s and GPU bf16 matmul TFLOP/s.

Shape rates, measured once per model shape (a preset with a new shape is measured when first predicted): seconds
at a few token counts per step T, chosen by (token, expert) pairs per expert T·k/E (``LOADS``), because that,
not FLOPs alone, sets how efficient small per-expert products are:
    cpu_forward_s, cpu_backward_s          one MoE layer's routed experts + LoRA on our native CPU kernels
    gpu_experts_forward_s, _backward_s     the same on the GPU as offload computes them: the routed-expert list
                                           read on the host, LoRA factors copied over, grouped products, the
                                           factors' gradients copied back
    gpu_layer_s, gpu_rest_s                a LoRA training step of the whole model on the GPU (the ``gpu``
                                           paradigm, PEFT): per MoE layer, and everything else (embeddings,
                                           dense layers, LM head, loss, optimizer); from models of 1 and
                                           1 + ``GPU_LAYERS_APART`` MoE layers, at ``gpu_layer_tokens``
    gpu_attention_layer_s, _rest_s         the same with the routed experts left out: what co-compute and
                                           offload leave on the GPU
    cocompute_layer_s, _rest_s             a co-compute training step (moecc's own, GPU side on the GPU if
                                           any): per MoE layer and the rest, from models of 1 and 3 MoE layers
GPU entries are timed at ``gpu_tokens`` (``GPU_LOADS``), or at fewer loads and layers where the largest run out of
memory; they are absent without a GPU, or where a measurement could not run at all. Layers are
timed in bf16 with random weights, uniform routing and LoRA rank ``RANK``, in the standard expert layout.
"""
from __future__ import annotations

import gc
import json
import time
import warnings
from pathlib import Path

import torch

from .. import _ops
from ..experts import ExpertLora, ExpertWeights, grouped
from ..experts.native import NativeExperts
from . import rates_cache
from .presets import preset_config, random_model
from .rates_cache import VERSION, cached
from .shapes import RANK, SEQUENCE, moe_shape, shape_key
from .timing import adamw, best_of, synchronize, time_training

LOADS = (32, 128, 512)  # (token, expert) pairs per expert at which the CPU kernels and the GPU are timed
# Every load, since launch-bound small steps extrapolate badly.
GPU_LOADS = LOADS
# Models this many MoE layers apart average out the run-to-run noise of launch-bound layers (same README).
GPU_LAYERS_APART = 7
NO_EXPERTS = "moecc_plan_no_experts"  # the experts implementation that leaves the experts out


def token_counts(shape: dict, loads: tuple[int, ...] = LOADS) -> list[int]:
    """Tokens per step at which ``shape`` has ``loads`` (token, expert) pairs per expert under uniform routing."""
    return [max(1, round(load * shape["experts"] / shape["top_k"])) for load in loads]


def _timed_passes(shape: dict, tokens: list[int], device: torch.device, forward, backward,
                  repeats: int = 2) -> tuple[list[float], list[float]]:
    """Best forward and best backward seconds at each token count, over ``repeats`` runs after a warm-up run, on
    a routed batch of that size: ``forward(batch)`` returns what ``backward(saved, batch)`` takes."""
    forward_s, backward_s = [], []
    for count in tokens:
        batch = _routed_batch(shape, count, device)
        best = [float("inf"), float("inf")]
        for run in range(repeats + 1):
            synchronize(device)
            start = time.perf_counter()
            saved = forward(batch)
            synchronize(device)
            middle = time.perf_counter()
            backward(saved, batch)
            synchronize(device)
            if run:
                best = [min(best[0], middle - start), min(best[1], time.perf_counter() - middle)]
        forward_s.append(best[0])
        backward_s.append(best[1])
    return forward_s, backward_s


def dram_read_gbps(gigabytes: float = 1.0) -> float:
    """Host memory read rate with torch's threads (a reduction over a buffer far larger than the caches)."""
    data = torch.ones(int(gigabytes * 1e9 / 4), dtype=torch.float32)
    return data.nbytes / best_of(lambda: data.sum()) / 1e9


def cpu_matmul_tflops(rows: int = 1024, size: int = 2048, budget_s: float = 0.05) -> float:
    """torch's bf16 matmul on the CPU, for the non-expert work where there is no GPU. Fewer rows where one product
    of 16 rows says the full one would take over ``budget_s``: on CPUs without bf16 instructions torch's bf16
    matmul ran at 0.3 GFLOP/s, and five products of 1024 rows took 115 s."""
    a, b = torch.randn(rows, size).bfloat16(), torch.randn(size, size).bfloat16()
    start = time.perf_counter()
    a[:16] @ b
    per_row = (time.perf_counter() - start) / 16
    rows = max(16, min(rows, int(budget_s / max(per_row, 1e-12))))
    x = a[:rows]
    return 2 * rows * size * size / best_of(lambda: x @ b) / 1e12


def host_optimizer_ns_per_param(params: int = 8_000_000) -> float:
    """AdamW (the one ``moecc bench`` steps) over float32 parameters in host memory, as PEFT keeps LoRA factors."""
    weights = [torch.zeros(params // 4, requires_grad=True) for _ in range(4)]
    for weight in weights:
        weight.grad = torch.zeros_like(weight)
    return best_of(adamw(weights).step) / params * 1e9


def pcie_gbps(device: torch.device, megabytes: int = 512) -> tuple[float, float]:
    """(host→device, device→host) GB/s of pinned copies."""
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    return host.nbytes / best_of(h2d) / 1e9, host.nbytes / best_of(d2h) / 1e9


def gpu_tflops(device: torch.device, size: int = 4096) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def matmul():
        a @ a
        torch.cuda.synchronize(device)

    return 2 * size**3 / best_of(matmul) / 1e12


def machine_rates() -> dict:
    """The rates that do not depend on the model (see the module docstring)."""
    rates = {"dram_gbps": dram_read_gbps(), "cpu_matmul_tflops": cpu_matmul_tflops(),
             "host_optimizer_ns_per_param": host_optimizer_ns_per_param()}
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        rates["h2d_gbps"], rates["d2h_gbps"] = pcie_gbps(device)
        rates["gpu_tflops"] = gpu_tflops(device)
    return rates


def _random_layer(shape: dict, device: torch.device, rank: int):
    """One MoE layer's expert weights (bf16, standard layout) on ``device`` and its LoRA factors in host memory
    (float32, as PEFT keeps them); the values do not change timings."""
    experts, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]
    owner = type("PackedCopies", (), {})()  # NativeExperts keeps its packed weights on this

    def uniform(*size):
        return torch.empty(*size, dtype=torch.bfloat16, device=device).uniform_(-0.02, 0.02)

    weights = ExpertWeights(uniform(experts, 2 * inter, hidden), uniform(experts, hidden, inter), cache_owner=owner)
    lora = tuple(ExpertLora(torch.randn(rank * experts, fan_in) * 0.01, torch.randn(fan_out, rank * experts) * 0.01,
                            2.0, experts) for fan_in, fan_out in ((hidden, 2 * inter), (inter, hidden)))
    return weights, lora


def _routed_batch(shape: dict, tokens: int, device: torch.device):
    """Hidden states ``[T, H]``, uniform top-k routing ``[T, k]`` (indices, float32 weights), a gradient ``[T, H]``."""
    scores = torch.rand(tokens, shape["experts"], device=device)
    weights, index = scores.topk(shape["top_k"], dim=1)
    hidden = torch.randn(tokens, shape["hidden"], device=device, dtype=torch.bfloat16)
    return hidden, index, weights.softmax(-1), torch.randn_like(hidden)


def cpu_expert_passes(shape: dict, tokens: list[int], rank: int = RANK) -> tuple[list[float], list[float]]:
    """Seconds of one MoE layer's routed experts with LoRA on our native CPU kernels at each token count:
    (forward, backward)."""
    weights, lora = _random_layer(shape, torch.device("cpu"), rank)
    native = NativeExperts(_ops.best_isa())

    def forward(batch):
        hidden, index, routing, _ = batch
        out, saved = native.forward(weights, hidden, index, routing, *lora)
        native.release_result(out)  # as co-compute does once the output is on the device
        return saved

    def backward(saved, batch):
        native.release_result(native.backward(weights, saved, batch[3], *lora)[0])

    return _timed_passes(shape, tokens, torch.device("cpu"), forward, backward)


def gpu_expert_passes(shape: dict, tokens: list[int], device: torch.device,
                      rank: int = RANK) -> tuple[list[float], list[float]]:
    """Seconds of one MoE layer's routed experts with LoRA on ``device`` as the offload paradigm computes them
    there (weights already copied, LoRA factors on the device: ``MoeccConfig.offload_lora``'s usual choice; the
    planner adds the factors' copies where they stay in host memory), at each token count: (forward, backward)."""
    weights, host_lora = _random_layer(shape, device, rank)
    lora = [ExpertLora(f.A.to(device), f.B.to(device), f.scaling, f.num_experts) for f in host_lora]

    def forward(batch):
        hidden, index, routing, _ = batch
        torch.unique(index).tolist()  # offload's one host sync per layer: which experts to copy
        return grouped.forward(weights, hidden, index, routing, *lora)[1]

    def backward(saved, batch):
        grouped.backward(weights, saved, batch[3], *lora)

    return _timed_passes(shape, tokens, device, forward, backward)


def _no_experts(module, hidden_states, top_k_index, top_k_weights):
    """Routed experts that cost nothing; the output depends on the routing weights, so the router still trains."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def model_step_s(preset: str, layers: int, device: torch.device, tokens: list[int], experts: bool = True,
                 rank: int = RANK) -> list[float]:
    """Median seconds of a LoRA training step (as ``moecc bench`` times it) of ``preset`` cut to ``layers``
    decoder layers, built on ``device`` in bf16: LoRA on attention and experts as the ``gpu`` paradigm runs it, or
    with the routed experts left out (``experts=False``: LoRA on attention only)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ExpertsInterface

    from ..api import default_lora_config

    options = {}
    if not experts:
        ExpertsInterface.register(NO_EXPERTS, _no_experts)
        options["experts_implementation"] = NO_EXPERTS
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(preset_config(preset, layers), dtype=torch.bfloat16, **options)
    lora = default_lora_config(base, rank=rank)
    if not experts:
        lora.target_parameters = None
    model = get_peft_model(base, lora).train()
    try:
        return [time_training(model, device, count, steps=3, profile_gpu=False)["step_s"] for count in tokens]
    finally:
        del model, base
        if device.type == "cuda":
            torch.cuda.empty_cache()


def per_layer_and_rest(preset: str, device: torch.device, tokens: list[int], experts: bool,
                       apart: int = GPU_LAYERS_APART) -> tuple[list[float], list[float]]:
    """Step seconds per MoE layer, and of the rest of the step, at each token count: the difference of models
    with 1 + ``apart`` and one MoE layers (after any dense layers) over ``apart``, and what one MoE layer leaves
    of the smaller. Small-batch GPU layers are launch-bound and noisy; layers far apart average that out."""
    return _layer_and_rest(preset, lambda layers: model_step_s(preset, layers, device, tokens, experts),
                           apart=apart)


def _layer_and_rest(preset: str, step_s, apart: int) -> tuple[list[float], list[float]]:
    """``step_s(layers)`` (seconds per token count) for models of 1 and ``1 + apart`` MoE layers after any dense
    layers: per MoE layer, the difference over ``apart``; the rest, what one MoE layer leaves of the smaller."""
    dense = moe_shape(preset_config(preset))["dense_layers"]
    one, more = step_s(dense + 1), step_s(dense + 1 + apart)
    layer = [max(0.0, (b - a) / apart) for a, b in zip(one, more)]
    return layer, [max(0.0, a - per_layer) for a, per_layer in zip(one, layer)]


def _gpu_shape_rates(preset: str, shape: dict, device: torch.device) -> dict:
    """The GPU timings of ``shape`` (see the module docstring), each part at every load of ``GPU_LOADS`` and its
    models ``GPU_LAYERS_APART`` layers apart, or where that runs out of memory, at the first two loads, then also
    3 layers apart. A part that cannot run at all is left out with a warning (the planner estimates it from
    FLOPs); cheapest first, so a later failure keeps the others."""
    every = token_counts(shape, GPU_LOADS)
    attempts = [(every, GPU_LAYERS_APART), (every[:2], GPU_LAYERS_APART), (every[:2], 3)]

    def experts_and_attention(tokens: list[int], apart: int) -> dict:
        forward, backward = gpu_expert_passes(shape, tokens, device)
        layer, rest = per_layer_and_rest(preset, device, tokens, experts=False, apart=apart)
        return {"gpu_tokens": tokens, "gpu_experts_forward_s": forward, "gpu_experts_backward_s": backward,
                "gpu_attention_layer_s": layer, "gpu_attention_rest_s": rest}

    def whole_model(tokens: list[int], apart: int) -> dict:
        layer, rest = per_layer_and_rest(preset, device, tokens, experts=True, apart=apart)
        return {"gpu_layer_tokens": tokens, "gpu_layer_s": layer, "gpu_rest_s": rest}

    rates: dict = {}
    for part in (experts_and_attention, whole_model):
        for tokens, apart in dict.fromkeys((tuple(t), a) for t, a in attempts):
            timed, failure, out_of_memory = _attempt(part, list(tokens), apart, device)
            if timed is not None:
                rates.update(timed)
                break
            if not out_of_memory:
                break
        if timed is None:
            warnings.warn(f"moecc plan: part of {preset}'s GPU timings could not run ({failure}); the planner "
                          "estimates that part from FLOPs", stacklevel=2)
    return rates


def _attempt(part, tokens: list[int], apart: int, device: torch.device) -> tuple[dict | None, str, bool]:
    """``(part(tokens, apart), "", False)``, or ``(None, the error's first line, whether it ran out of memory)``.
    Nothing of the failed attempt is kept (its traceback holds the models it built), so a retry has the memory."""
    try:
        return part(tokens, apart), "", False
    except (RuntimeError, ValueError) as error:  # torch.cuda.OutOfMemoryError is a RuntimeError
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        # cuBLAS and the caching allocator outside PyTorch's own check report it as a plain RuntimeError
        out_of_memory = isinstance(error, torch.cuda.OutOfMemoryError) or any(
            words in str(error) for words in ("out of memory", "ALLOC_FAILED"))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None, text, out_of_memory


def _cocompute_step_s(preset: str, layers: int, device: torch.device, tokens: list[int]) -> list[float]:
    """Median seconds of a co-compute LoRA training step (as ``moecc bench`` times it) of ``preset`` cut to
    ``layers`` decoder layers, built as ``moecc bench`` builds it (tokens spread over the experts as trained
    routers spread them). ``tokens`` must be whole sequences (see :func:`cocompute_token_counts`)."""
    from ..api import default_lora_config, prepare

    base = random_model(preset, layers, torch.float32 if preset == "tiny" else torch.bfloat16)
    model = prepare(base, lora_config=default_lora_config(base, rank=RANK), paradigm="cocompute", device=device)
    try:
        return [time_training(model, device, count, steps=3, max_seconds=10.0, profile_gpu=False)["step_s"]
                for count in tokens]
    finally:
        del model, base
        if device.type == "cuda":
            torch.cuda.empty_cache()


def cocompute_token_counts(shape: dict) -> list[int]:
    """``token_counts`` rounded to what a ``moecc bench`` step runs: one sequence up to 2048 tokens, whole
    sequences of 2048 beyond."""
    return [count if count <= SEQUENCE else count // SEQUENCE * SEQUENCE for count in token_counts(shape)]


def cocompute_layer_and_rest(preset: str, device: torch.device, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Co-compute step seconds per MoE layer, and of the rest of the step, at each token count: half the
    difference of models with three and one MoE layers (after any dense layers; two layers apart halve the
    timing noise in the slope the planner multiplies by up to 48), and what one MoE layer leaves of the smaller.
    Timed in place: the kernels timed alone did not predict them inside a step."""
    return _layer_and_rest(preset, lambda layers: _cocompute_step_s(preset, layers, device, tokens), apart=2)


def measure_shape(preset: str) -> dict:
    """The shape rates of ``preset`` (see the module docstring): a few seconds on the CPU, and on the GPU if any."""
    shape = moe_shape(preset_config(preset))
    tokens = token_counts(shape)
    rates: dict = {"tokens": tokens}
    rates["cpu_forward_s"], rates["cpu_backward_s"] = cpu_expert_passes(shape, tokens)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        rates["cocompute_tokens"] = cocompute_token_counts(shape)
        rates["cocompute_layer_s"], rates["cocompute_rest_s"] = cocompute_layer_and_rest(
            preset, device, rates["cocompute_tokens"])
    except (RuntimeError, ValueError) as error:  # out of memory, say: the planner sums the parts instead
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        warnings.warn(f"moecc plan: {preset}'s co-compute steps could not be timed ({text}); the planner adds up "
                      "its parts instead", stacklevel=2)
    if device.type == "cuda":
        rates.update(_gpu_shape_rates(preset, shape, device))
    return rates


class MachineRates(dict):
    """Rates from :func:`measure`: rate name -> value, and ``"shapes"``: shape key -> shape rates. It knows its
    cache file, so :func:`shape_rates` measures a shape seen for the first time once and saves it."""

    def __init__(self, rates: dict, cache: Path) -> None:
        super().__init__(rates)
        self.setdefault("shapes", {})
        self.cache = cache

    def shape_rates(self, preset: str) -> dict:
        """``preset``'s shape rates, measured now (and saved) when they are missing."""
        return shape_rates(self, preset)

    def save(self) -> None:
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        self.cache.write_text(json.dumps({"version": VERSION, **self}, indent=2))


def measure(remeasure: bool = False, cache: Path | None = None) -> MachineRates:
    """The machine's rates, from ``cache`` (default ``rates_cache.CACHE``) unless it is missing, from another
    version of this module, or ``remeasure`` is set (which also drops every shape's rates)."""
    cache = cache or rates_cache.CACHE
    saved = None if remeasure else cached(cache)
    if saved is not None:
        return MachineRates(saved, cache)
    rates = MachineRates(machine_rates(), cache)
    rates.save()
    return rates


def shape_rates(rates: dict, preset: str) -> dict | None:
    """``preset``'s shape rates from ``rates["shapes"]``; measured now (and saved) when ``rates`` came from
    :func:`measure` and lacks them, None when a plain dict lacks them."""
    key = shape_key(moe_shape(preset_config(preset)))
    found = rates.get("shapes", {}).get(key)
    if found is None and isinstance(rates, MachineRates):
        found = rates["shapes"][key] = measure_shape(preset)
        rates.save()
    return found
