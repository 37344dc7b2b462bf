"""What hybrid's CPU part costs alone: the native backend's forward and backward on the coldest m experts of a
random top-k routing (``expert_mask``), against the whole layer, as hybrid runs it on a GPU machine (the pool on
all CPUs but two; a subset whose results leave as rows writes them, and its experts' LoRA gradient blocks alone,
into buffers of its own, as hybrid's CPU part does into staging: path ``into``; else ``pairs``). Prints one line
per (tokens, experts, load): the subset's routed pairs, median forward / backward ms, and of those the ms inside
the kernels' phases (the rest is Python and torch around them), and the path.

``--loads`` runs each case under other work, interleaved: ``alone``; ``stream``, a thread copying pinned host memory
to the GPU without pause (PCIe's share of DRAM, as hybrid's copies take it); ``host``, a Python thread queueing
small GPU ops without pause (the host thread, which takes the GIL between the worker's torch calls); ``both``.

    python benchmarks/bench_cpu_subset.py --tokens 512,2048,8192 --experts 1,16,40,128
    python benchmarks/bench_cpu_subset.py --tokens 512,2048 --experts 4,16,32 --loads alone,stream,host,both

``--phases`` also prints, per case, the median ms of each kernel phase and, per product phase, the thread-ms spent
packing weights, in the panel products and in the epilogues (what the kernels' time is made of).

    python benchmarks/bench_cpu_subset.py --tokens 2048,8192 --experts 28,15 --loads alone,stream --phases
"""
from __future__ import annotations

import argparse
import statistics
import time

import moecc  # noqa: F401  (before torch: its OpenMP threads sleep between ops, as moecc runs them)
import torch

import contextlib
import threading

from moecc import _C, _ops
from moecc.experts import LoraGrads
from moecc.experts.native import NativeExperts, rows_pay
from moecc.experts.types import ExpertLora, ExpertWeights, PairGrads
from moecc.paradigms.cpu_part import configure_cpu_threads


def layer(experts: int, hidden: int, inter: int, rank: int, seed: int = 0):
    """Random bf16 expert weights and float32 LoRA factors of one layer (Qwen3-30B-A3B's by default)."""
    g = torch.Generator().manual_seed(seed)
    weights = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16(),
                            (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16())
    gate_up = ExpertLora(torch.randn(rank * experts, hidden, generator=g) * 0.01,
                         torch.randn(2 * inter, rank * experts, generator=g) * 0.01, 2.0, experts)
    down = ExpertLora(torch.randn(rank * experts, inter, generator=g) * 0.01,
                      torch.randn(hidden, rank * experts, generator=g) * 0.01, 2.0, experts)
    return weights, gate_up, down


@contextlib.contextmanager
def load(kind: str):
    """Runs ``kind``'s other work (see the module docstring) on threads while the body runs."""
    stop = threading.Event()

    def stream() -> None:
        source = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(source, device="cuda")
        copies = torch.cuda.Stream()
        with torch.cuda.stream(copies):
            while not stop.is_set():
                target.copy_(source, non_blocking=True)
                copies.synchronize()

    def host() -> None:  # on the CPU device without CUDA: the same GIL traffic
        cuda = torch.cuda.is_available()
        x = torch.zeros(1024, device="cuda" if cuda else "cpu")
        while not stop.is_set():
            for _ in range(64):
                x.add_(1.0)
            if cuda:
                torch.cuda.current_stream().synchronize()

    jobs = {"alone": [], "stream": [stream], "host": [host], "both": [stream, host]}[kind]
    if stream in jobs and not torch.cuda.is_available():
        raise SystemExit(f"--loads {kind} needs a CUDA GPU")
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    time.sleep(0.2 if jobs else 0.0)
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def phases_s(backward: bool) -> float:
    """Seconds in the phases of the latest native call of that direction."""
    return sum(seconds for _, seconds in _C.last_phase_times(backward))


def phase_breakdown(backward: bool) -> dict[str, float]:
    """Seconds of each phase of the latest native call of that direction, and per product phase its threads'
    seconds packing, in the products and in the epilogues (``phase:pack``, ``phase:gemm``, ``phase:epilogue``)."""
    parts = {name: seconds for name, seconds in _C.last_phase_times(backward)}
    for name, pack, gemm, epilogue in _C.last_product_parts(backward):
        parts.update({f"{name}:pack": pack, f"{name}:gemm": gemm, f"{name}:epilogue": epilogue})
    return parts


def hybrid_buffers(weights: ExpertWeights, loras: tuple, tokens: int, top_k: int, chosen: torch.Tensor,
                   pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PairGrads]:
    """What hybrid's CPU part writes into when its results leave as rows (``forward_pairs_into``,
    ``backward_pairs_into``): the forward's bf16 rows, tokens and routing weights, and the backward's rows,
    tokens, routing-weight gradient and LoRA gradient blocks of the ``chosen`` experts alone."""
    hidden, experts, n = weights.hidden_size, weights.num_experts, chosen.numel()

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # pinned, as staging is on CUDA
        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

    blocks = []
    for lora in loras:
        rank = lora.A.shape[0] // experts
        blocks += [empty(n, rank, lora.A.shape[1]), empty(lora.B.shape[0], rank, n)]
    grads = PairGrads(empty(pairs, hidden, dtype=torch.bfloat16), empty(pairs, dtype=torch.int64),
                      empty(tokens, top_k), chosen.to(torch.int64).contiguous(), tuple(blocks))
    return empty(pairs, hidden, dtype=torch.bfloat16), empty(pairs, dtype=torch.int64), empty(pairs), grads


def time_subset(backend: NativeExperts, weights, loras, tokens: int, top_k: int, coldest: int, reps: int,
                seed: int = 0, breakdowns: list | None = None) -> tuple[int, float, float, float, float, str]:
    """(routed pairs of the ``coldest`` experts, median forward s, median backward s, the medians of their
    kernels' phases, and the path: ``into`` or ``pairs``, as hybrid runs the part) after two warm-up calls;
    ``breakdowns``: a list each timed call pair appends its (forward, backward) :func:`phase_breakdown` to."""
    g = torch.Generator().manual_seed(seed)
    experts = weights.num_experts
    top_w, top_i = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k, dim=-1)
    counts = torch.bincount(top_i.reshape(-1), minlength=experts)
    chosen = torch.argsort(counts, stable=True)[:coldest]
    mask = None
    if coldest < experts:
        mask = torch.zeros(experts, dtype=torch.bool)
        mask[chosen] = True
    hidden = torch.randn(tokens, weights.hidden_size, generator=g).bfloat16()
    grad_out = torch.randn(tokens, weights.hidden_size, generator=g).bfloat16()
    pairs = int(counts[chosen].sum())
    into = mask is not None and rows_pay(pairs, tokens) and hybrid_buffers(weights, loras, tokens, top_k, chosen,
                                                                           pairs)
    forward, backward, forward_in, backward_in = [], [], [], []
    for rep in range(reps + 2):  # as hybrid calls it: rows per pair, every result given back
        start = time.perf_counter()
        if into:  # hybrid's steady state: the kernels write into buffers the device reads (its staging)
            saved = backend.forward_pairs_into(weights, hidden, top_i, top_w, *loras, expert_mask=mask,
                                               rows=into[0], tokens=into[1], weights_out=into[2])
            out = None
        else:
            out, _, saved = backend.forward_pairs(weights, hidden, top_i, top_w, *loras, expert_mask=mask)
        middle = time.perf_counter()
        inside_forward, forward_parts = phases_s(False), phase_breakdown(False)
        if into:
            backend.backward_pairs_into(weights, saved, grad_out, *loras, out=into[3])
            grad_hidden, grads = None, LoraGrads(None, None, None, None)
        else:
            grad_hidden, _, _, grads = backend.backward_pairs(weights, saved, grad_out, *loras)
        end = time.perf_counter()
        inside_backward = phases_s(True)
        if breakdowns is not None and rep >= 2:
            breakdowns.append((forward_parts, phase_breakdown(True)))
        for result in (out, grad_hidden, *vars(grads).values()):
            if result is not None:
                backend.release_result(result)
        if rep >= 2:
            forward.append(middle - start)
            backward.append(end - middle)
            forward_in.append(inside_forward)
            backward_in.append(inside_backward)
    return (pairs, *(statistics.median(v) for v in (forward, backward, forward_in, backward_in)),
            "into" if into else "pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--experts", default="1,16,40,128", help="coldest experts on the CPU; all of them: the "
                                                                 "full path")
    parser.add_argument("--shape", default="128,2048,768,8", help="experts,hidden,intermediate,top_k")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loads", default="alone", help="comma-separated, of alone, stream, host, both "
                                                          "(interleaved per case)")
    parser.add_argument("--phases", action="store_true", help="also print each kernel phase's median ms")
    args = parser.parse_args()
    experts, hidden, inter, top_k = (int(v) for v in args.shape.split(","))
    threads = configure_cpu_threads()
    backend = NativeExperts(_ops.best_isa())
    weights, gate_up, down = layer(experts, hidden, inter, args.rank)
    print(f"isa {backend.isa}, {threads} pool threads, {torch.get_num_threads()} torch threads, shape "
          f"{args.shape}, rank {args.rank}", flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for coldest in (min(int(m), experts) for m in args.experts.split(",")):
            for kind in args.loads.split(","):
                breakdowns: list = []
                with load(kind):
                    pairs, forward, backward, forward_in, backward_in, path = time_subset(
                        backend, weights, (gate_up, down), tokens, top_k, coldest, args.reps, breakdowns=breakdowns)
                print(f"tokens {tokens} experts {coldest} pairs {pairs} {kind}: forward {1e3 * forward:.2f} ms "
                      f"({1e3 * forward_in:.2f} in the kernel's phases), backward {1e3 * backward:.2f} ms "
                      f"({1e3 * backward_in:.2f}) [{path}]", flush=True)
                if args.phases:
                    for direction, which in (("forward", 0), ("backward", 1)):
                        names = breakdowns[0][which]
                        medians = {name: statistics.median(b[which].get(name, 0.0) for b in breakdowns)
                                   for name in names}
                        print(f"    {direction} ms: " + ", ".join(f"{name} {1e3 * seconds:.2f}"
                                                              for name, seconds in medians.items()), flush=True)


if __name__ == "__main__":
    main()
