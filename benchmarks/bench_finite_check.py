"""What the default non-finite check costs: one MoE layer's forward + backward with ``check_finite`` on and off.

Builds one decoder layer of the preset (random weights, bf16), prepares it with co-compute on the CPU device and
times its sparse MoE block (router + routed experts with rank-8 LoRA) on ``--tokens`` tokens: forward, then backward
from a fixed output gradient. The check on and off alternate step by step, so drift in the machine's speed falls on
both alike; each is the median of ``--reps`` steps after a warm-up. The check's own work (the finite flags of the
layer's inputs, reduced where they are) is also timed alone, over the same tensors, as it is much smaller than the
step's run-to-run noise. Prints one line per token count.

    python benchmarks/bench_finite_check.py --preset qwen3-30b-a3b --tokens 512,8192 --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import moecc  # before torch: sets OMP_WAIT_POLICY=PASSIVE for the kernels' threads
import torch

from moecc.bench.presets import PRESETS, random_model
from moecc.paradigms.base import FiniteFlags


def step_seconds(block: torch.nn.Module, hidden: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    out = block(hidden)  # [1, T, H]
    out.backward(grad)
    seconds = time.perf_counter() - start
    hidden.grad = None
    block.zero_grad(set_to_none=True)
    return seconds


def flags_seconds(layer, hidden: torch.Tensor, weights: torch.Tensor, reps: int = 20) -> float:
    """Median seconds of the check's own work on one layer call's inputs (reduced and read once)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        FiniteFlags(layer, hidden, weights, 0).flags.tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", default="512,8192", help="token counts, separated by commas")
    parser.add_argument("--reps", type=int, default=5, help="timed steps of each setting per token count")
    args = parser.parse_args()

    base = random_model(args.preset, layers=1, dtype=torch.bfloat16)
    model = moecc.prepare(base, lora_config=moecc.default_lora_config(base, rank=8), device="cpu",
                          paradigm="cocompute")
    engine = model.moecc.engine
    block = model.get_base_model().model.layers[0].mlp
    config = base.config
    print(f"# {args.preset}: one MoE layer, H={config.hidden_size} E={config.num_experts} "
          f"k={config.num_experts_per_tok} I={config.moe_intermediate_size}, rank 8, co-compute on the CPU "
          f"({moecc._ops.num_threads()} threads, {model.moecc.layers[0].weights.format} experts)")
    print("tokens | check off ms | check on ms | on/off - 1 | check's own work ms | own work / step")
    generator = torch.Generator().manual_seed(0)
    for tokens in (int(t) for t in args.tokens.split(",")):
        hidden = torch.randn(1, tokens, config.hidden_size, generator=generator).bfloat16().requires_grad_()
        grad = torch.randn(1, tokens, config.hidden_size, generator=generator).bfloat16() * 1e-3
        seconds = {True: [], False: []}
        for rep in range(args.reps + 1):  # the first of each: a warm-up (buffers grow, pages fault in)
            for check in (rep % 2 == 0, rep % 2 == 1):  # alternating which goes first
                engine.check_finite = check
                elapsed = step_seconds(block, hidden, grad)
                if rep:
                    seconds[check].append(elapsed)
        off, on = (statistics.median(seconds[c]) for c in (False, True))
        weights = torch.rand(tokens, config.num_experts_per_tok, generator=generator).bfloat16()
        own = flags_seconds(model.moecc.layers[0], hidden.detach()[0], weights)
        print(f"{tokens} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off - 1:+.2%} | {own * 1e3:.3f} | {own / off:.3%}")
    engine.check_finite = True


if __name__ == "__main__":
    main()
