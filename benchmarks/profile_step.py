"""Where one training step of a paradigm leaves the GPU idle: a diagnosis aid for a step slower than its copies
and kernels, and for co-compute's time outside the CPU experts.

Builds the ``moecc bench`` model (random weights, LoRA on attention and experts) under the GPU budget, times a
few steps as the bench does (falling back to gradient checkpointing when a step runs out of memory), then runs
one step under the profiler and prints: the step's span, the time the GPU ran kernels, copied host to device,
and did neither; the idle time by the host operation running when each gap began; the allocator's retries.

    python benchmarks/profile_step.py --paradigm offload --tokens 2048,8192
"""
from __future__ import annotations

import argparse
import json

import moecc  # noqa: F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
import torch
from torch.profiler import ProfilerActivity, profile

from moecc.bench import runner, timing
from moecc.bench.idle import idle_report
from moecc.losses import chunked_causal_lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--paradigm", default="offload", choices=["cocompute", "offload", "gpu"])
    parser.add_argument("--tokens", default="8192", help="tokens per step, comma-separated (one model for all)")
    parser.add_argument("--gpu-budget", type=float, default=24.0)
    parser.add_argument("--checkpointing", default="auto", choices=runner.CHECKPOINTING)
    parser.add_argument("--min-gap-us", type=float, default=500.0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA GPU: the step runs on the CPU, where every second counts as GPU idle time")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, _, state = runner.build_for_timing(args.preset, args.layers, args.paradigm, device, args.gpu_budget,
                                              args.checkpointing)
    for tokens in (int(t) for t in args.tokens.split(",")):
        profile_tokens(model, device, tokens, state, args.paradigm, args.min_gap_us)


def profile_tokens(model: torch.nn.Module, device: torch.device, tokens: int, state: dict, paradigm: str,
                   min_gap_us: float) -> None:
    """Times steps of ``tokens`` as the bench does, then profiles one and prints where the GPU sat idle."""
    timed = runner.time_with_checkpointing(model, device, tokens, 2, state, None, profile_gpu=False)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in timed.items()}
                     | {"checkpointing": state["on"]}), flush=True)
    cuda = device.type == "cuda"
    optimizer = timing.adamw(model.parameters())
    seq = min(tokens, timing.SEQUENCE)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // seq), seq), device=device)

    def step() -> None:
        with torch.profiler.record_function("forward+backward"):
            chunked_causal_lm_loss(model, ids, ids).backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the profiled step
    timing.synchronize(device)

    def retries() -> int:
        return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0

    before = retries()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        timing.synchronize(device)
    report = idle_report(prof.events(), min_gap_us)
    print(f"profiled step ({paradigm}, {ids.numel()} tokens): span {report.span_s:.3f} s, kernels "
          f"{report.kernels_s:.3f} s, host-to-device copies {report.copies_s:.3f} s, neither {report.idle_s:.3f} s; "
          f"allocator retries {retries() - before}")
    print(f"idle (gaps of {min_gap_us:g} us or more) by the host operation running when the gap began:")
    for name, seconds in report.by_host_op.items():
        print(f"  {seconds:8.3f} s  {name[:100]}")


if __name__ == "__main__":
    main()
