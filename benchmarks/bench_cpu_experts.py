"""One MoE layer of routed experts with LoRA on the CPU: moecc's native kernels against a PyTorch loop.

For each shape, token count and routing (uniform, or Zipf(1.2) popularity: a few hot experts) it times the
forward and backward of the native backend (median of --reps after a warm-up) and the per-expert PyTorch loop
that Hugging Face's eager experts run. Prints one line per case and writes a markdown table, JSON and (with
matplotlib) a PNG plot under --out.

The native kernels run as moecc runs them: moecc is imported before torch, so torch's OpenMP threads sleep
between ops (OMP_WAIT_POLICY=PASSIVE) instead of spinning on the cores the kernel threads need. The loop runs in
a child process under the OpenMP setting this script was started with (torch's default: spinning), its best.

    python benchmarks/bench_cpu_experts.py --shapes qwen3-30b-a3b --tokens 256,1024,4096,8192
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

_STARTED_WITH_OMP_POLICY = os.environ.get("OMP_WAIT_POLICY")
if "--loop-only" not in sys.argv:  # the loop's child keeps the policy it was started with
    import moecc  # noqa: F401  (before torch: sets OMP_WAIT_POLICY=PASSIVE unless the caller set it)
import torch  # noqa: E402

from moecc import _ops  # noqa: E402
from moecc.experts.native import NativeExperts  # noqa: E402
from moecc.experts import ExpertLora, ExpertWeights  # noqa: E402
from moecc.experts.formats import quantize  # noqa: E402

SHAPES = {  # experts, top_k, hidden, intermediate
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
DRAM_GBPS = 125.0  # host DRAM read rate on 16 threads of a 16-core Xeon with AMX: the floor's rate
# The best public CPU MoE fine-tuning kernel on that Xeon, Qwen3-30B-A3B shape, Zipf(1.2) routing, forward /
# backward ms; moecc's target is half their sum.
PEER_MS = {256: (32, 64), 1024: (48, 92), 4096: (104, 200), 8192: (176, 312)}


def routing(tokens: int, experts: int, top_k: int, kind: str, generator: torch.Generator):
    if kind == "uniform":
        scores = torch.rand(tokens, experts, generator=generator)
        index = scores.topk(top_k, dim=1).indices
    else:  # Zipf(1.2) popularity over a random expert order, k distinct experts per token
        popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        popularity = popularity[torch.randperm(experts, generator=generator)]
        index = torch.multinomial(popularity.expand(tokens, -1), top_k, replacement=False, generator=generator)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=1)
    return index, weights


def torch_loop(weights: ExpertWeights, x, index, w, gate_up: ExpertLora, down: ExpertLora):
    """Hugging Face eager experts with factorised LoRA, one expert at a time (autograd on)."""
    out = torch.zeros_like(x)
    for expert in range(weights.num_experts):
        tokens, slots = torch.where(index == expert)
        if tokens.numel() == 0:
            continue
        (a1, b1), (a2, b2) = gate_up.factors(expert), down.factors(expert)
        h = x[tokens]
        gu = h @ weights.gate_up[expert].T + (gate_up.scaling * (h.float() @ a1.T) @ b1.T).to(h.dtype)
        gate, up = gu.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        y = act @ weights.down[expert].T + (down.scaling * (act.float() @ a2.T) @ b2.T).to(h.dtype)
        out.index_add_(0, tokens, y * w[tokens, slots, None].to(y.dtype))
    return out


# Iterations of the register-only peak loops (moecc._C.peak_flops), per matrix unit.
PEAK_ITERATIONS = {"avx512_bf16": 2_000_000, "amx": 200_000, "avx512_fma": 2_000_000}


def measure_peaks() -> dict[str, float]:
    """Per-core and all-thread FLOP/s of the units this CPU has (register-only loops): bf16 for the matrix units,
    float32 FMA for AVX512 (the epilogues' arithmetic)."""
    from moecc import _C

    peaks = {}
    for isa, iterations in PEAK_ITERATIONS.items():
        try:
            peaks[f"{isa}_core"] = _C.peak_flops(isa, iterations)
            peaks[f"{isa}_all"] = _C.peak_flops(isa, iterations, _ops.num_threads())
        except ValueError:
            continue
    return peaks


def per_cpu_peaks(isa: str) -> dict[int, float]:
    """Single-thread register-only bf16 FLOP/s of ``isa``'s matrix unit ('amx' or 'avx512_bf16') on each CPU this
    process may use, one at a time, the others idle. A CPU whose core something else shares (a VM's vCPU on a busy
    machine) shows at a fraction of the rest, and every all-thread phase then waits on it."""
    from moecc import _C

    mask = os.sched_getaffinity(0)
    rates = {}
    try:
        for cpu in sorted(mask):
            os.sched_setaffinity(0, {cpu})  # this thread only
            rates[cpu] = _C.peak_flops(isa, PEAK_ITERATIONS[isa] // 2)  # one CPU after another: shorter runs
    finally:
        os.sched_setaffinity(0, mask)
    return rates


def describe_cpu_peaks(isa: str, rates: dict[int, float]) -> str:
    """One line: the per-CPU peaks' range and the CPUs below 0.8 of their median."""
    median = statistics.median(rates.values())
    slow = [cpu for cpu, rate in rates.items() if rate < 0.8 * median]
    slowest = min(rates, key=rates.get)
    return (f"Single-thread {isa} peak per CPU (each alone): min {rates[slowest] / 1e12:.2f} TFLOP/s (CPU {slowest}), "
            f"median {median / 1e12:.2f}, max {max(rates.values()) / 1e12:.2f}; below 0.8 of the median: "
            + (", ".join(f"CPU {cpu} ({rates[cpu] / 1e12:.2f})" for cpu in slow) or "none") + ".")


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second, read plus written, of the fastest of ``reps`` copies of ``nbytes`` between two float32
    tensors on torch's threads: how fast the host's memory answers right now. Taken before and after the cases,
    beside the register-only peaks, because a shared machine can slow down in every phase, memory-bound copies
    included, while the peaks read before the cases stay the same."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = rep_times(lambda: dst.copy_(src), reps)
    return 2 * nbytes / min(times)


def describe_host_state(before: dict[str, float], after: dict[str, float]) -> str:
    """One line: the host's copy bandwidth and all-thread peaks before and after the cases (dicts of
    copy_bandwidth under "copy" and measure_peaks' entries)."""
    parts = [f"memory copy {before['copy'] / 1e9:.0f} / {after['copy'] / 1e9:.0f} GB/s"] if "copy" in before else []
    parts += [f"{key} {before[key] / 1e12:.2f} / {after[key] / 1e12:.2f} TFLOP/s"
              for key in before if key.endswith("_all") and key in after]
    return "Host state before / after the cases: " + "; ".join(parts) + "."


def rep_times(fn, reps: int, setup=None) -> list[float]:
    """Seconds of ``fn()`` in each of ``reps`` runs after a warm-up; ``setup()`` runs untimed before each."""
    if setup:
        setup()
    fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn, reps: int, setup=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after a warm-up (see rep_times)."""
    return statistics.median(rep_times(fn, reps, setup))


def product_parts(backward: bool) -> dict[str, dict[str, float]]:
    """Thread-milliseconds of the latest call's product phases spent packing weights, in the panel products and in
    their epilogues (summed over the pool's threads; the phase's wall time x threads, less these, is waiting)."""
    from moecc import _C

    return {phase: {"pack": round(pack * 1e3, 1), "gemm": round(gemm * 1e3, 1), "epilogue": round(epilogue * 1e3, 1)}
            for phase, pack, gemm, epilogue in _C.last_product_parts(backward)}


def resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_case(shape: str, tokens: int, kind: str, rank: int, expert_format: str = "bf16"):
    """(weights, gate_up LoRA, down LoRA, x, index, routing weights, grad_out): the same for the same arguments;
    the weights held in ``expert_format`` (``bf16``, or a quantized format, ``int4:GROUP`` for int4's group)."""
    experts, top_k, hidden, inter = SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    gc.collect()
    weights = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16(),
                            (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16(),
                            cache_owner=types.SimpleNamespace())  # keeps the packed copy between calls
    if expert_format != "bf16":  # one quantized copy; the bf16 tensors are shape-only placeholders
        format, _, group = expert_format.partition(":")
        matrices = (weights.gate_up, weights.down)
        gate_up_q, down_q = (quantize(m, format, int(group) if group else None) for m in matrices)
        weights = ExpertWeights(*(torch.empty((), dtype=torch.bfloat16).expand(m.shape) for m in matrices),
                                gate_up_q=gate_up_q, down_q=down_q)
    gate_up = ExpertLora(torch.randn(rank * experts, hidden, generator=g) * 0.01,
                         torch.randn(2 * inter, rank * experts, generator=g) * 0.01, 2.0, experts)
    down = ExpertLora(torch.randn(rank * experts, inter, generator=g) * 0.01,
                      torch.randn(hidden, rank * experts, generator=g) * 0.01, 2.0, experts)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    index, w = routing(tokens, experts, top_k, kind, g)
    # bf16, as autograd hands it over: the layer's output is bf16 (the model's dtype), and so is its gradient in a
    # training step (co-compute passes it on as it arrives). A float32 gradient would add a conversion and a
    # float32 input gradient, page-faulted fresh each call, that no bf16 model pays.
    grad_out = torch.randn(tokens, hidden, generator=g).bfloat16()
    return weights, gate_up, down, x, index, w, grad_out


def loop_times(shape: str, tokens: int, kind: str, rank: int) -> tuple[float, float]:
    """(forward, backward) seconds of the PyTorch per-expert loop, autograd on."""
    weights, gate_up, down, x, index, w, grad_out = make_case(shape, tokens, kind, rank)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    forward = median_time(lambda: torch_loop(weights, xb, index, wb, gate_up, down), 1)
    out = torch_loop(weights, xb, index, wb, gate_up, down)
    backward = median_time(lambda: out.backward(grad_out, retain_graph=True), 1)
    return forward, backward


def loop_baseline(args: argparse.Namespace) -> dict:
    """The loop's times for every case, from a child process under the OpenMP policy this script started with."""
    env = dict(os.environ)
    if _STARTED_WITH_OMP_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = _STARTED_WITH_OMP_POLICY
    command = [sys.executable, __file__, "--loop-only", "--shapes", args.shapes, "--tokens", args.tokens,
               "--routing", args.routing, "--rank", str(args.rank)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the PyTorch-loop baseline failed:\n{done.stderr[-2000:]}")
    return {tuple(key.split("/")): value for key, value in json.loads(done.stdout.splitlines()[-1]).items()}


def run_case(shape: str, tokens: int, kind: str, rank: int, reps: int, native: NativeExperts,
             baseline: dict | None, expert_format: str = "bf16"):
    experts, top_k, hidden, inter = SHAPES[shape]
    weights, gate_up, down, x, index, w, grad_out = make_case(shape, tokens, kind, rank, expert_format)

    state = {}

    def give_back_results():  # as co-compute does once they are on the device: later calls reuse their pages
        for key in ("out", "grad"):
            if key in state:
                native.release_result(state.pop(key))

    def forward():
        give_back_results()
        state["out"], state["saved"] = native.forward(weights, x, index, w, gate_up, down)

    def backward():
        state["grad"] = native.backward(weights, state["saved"], grad_out, gate_up, down)[0]

    def release():  # as a training step's backward would: the next forward reuses the saved buffers
        if "saved" in state:
            native.release(state["saved"])
        give_back_results()

    from moecc import _C

    if native.prepack:  # the packed copy is made before the scratch is measured: it is the weights' size again
        native.prepare_layers([weights])
    resident_before_kernels = resident_bytes()
    forward_reps = rep_times(forward, reps, setup=release)
    forward_s = statistics.median(forward_reps)
    forward_phases = {name: round(sec * 1e3, 2) for name, sec in _C.last_phase_times(False)}
    forward_parts = product_parts(False)
    # A forward's saved state serves one backward (its buffers go back to the pool), so each backward gets a
    # fresh, untimed forward.
    backward_reps = rep_times(backward, reps, setup=forward)
    backward_s = statistics.median(backward_reps)
    backward_phases = {name: round(sec * 1e3, 2) for name, sec in _C.last_phase_times(True)}
    backward_parts = product_parts(True)
    # Host memory the kernels add while they run: the weights are read in place (no copy); this is their scratch
    # (per routed pair, shared by all layers of a model), this layer's saved activations and LoRA re-layouts.
    scratch_gb = (resident_bytes() - resident_before_kernels) / 1e9
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    active = int((counts > 0).sum())
    weight_bytes = active * 3 * hidden * inter * 2
    flops = 6 * tokens * top_k * hidden * inter  # per pass; backward does the same input-side products
    # The best rep beside the median: on a shared machine the spread between reps (and runs) is mostly its own.
    best_s = min(forward_reps) + min(backward_reps)
    row = dict(shape=shape, tokens=tokens, routing=kind, isa=native.isa, forward_ms=forward_s * 1e3,
               backward_ms=backward_s * 1e3, best_ms=best_s * 1e3, forward_tflops=flops / forward_s / 1e12,
               backward_tflops=flops / backward_s / 1e12, forward_gbps=weight_bytes / forward_s / 1e9,
               dram_floor_ms=weight_bytes / DRAM_GBPS / 1e6, max_over_mean=float(counts.max() / counts.float().mean()),
               forward_phases_ms=forward_phases, backward_phases_ms=backward_phases,
               forward_product_parts_thread_ms=forward_parts, backward_product_parts_thread_ms=backward_parts,
               weights_gb=sum(q.nbytes if q is not None else m.nbytes for m, q in
                              ((weights.gate_up, weights.gate_up_q), (weights.down, weights.down_q))) / 1e9,
               scratch_gb=scratch_gb, expert_format=expert_format)
    if shape == "qwen3-30b-a3b" and tokens in PEER_MS:
        row["target_ms"] = 0.5 * sum(PEER_MS[tokens])
    if baseline is not None:
        loop_forward, loop_backward = baseline[(shape, str(tokens), kind)]
        row.update(loop_forward_ms=loop_forward * 1e3, loop_backward_ms=loop_backward * 1e3,
                   speedup=(loop_forward + loop_backward) / (forward_s + backward_s))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--tokens", default="256,1024,4096,8192")
    parser.add_argument("--routing", default="uniform,zipf")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--isa", default="auto")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/cpu_experts")
    parser.add_argument("--task-shape", default=None, metavar="PANELS,GRAD_COLUMNS[,ROWS[,BLOCK_ROWS]]",
                        help="shape of the product tasks: forward output panels of 16 columns per task, input-"
                             "gradient columns per task (multiple of 16), rows per task, rows per product call "
                             "inside a task (0: all); default: built-in (16,256,1024,0)")
    parser.add_argument("--prepack", action="store_true",
                        help="forward products read a packed copy of the weights instead of packing per task "
                             "(MoeccConfig.prepack_weights: doubles the experts' memory)")
    parser.add_argument("--expert-format", default="bf16", metavar="FORMAT",
                        help="the frozen experts' format: bf16, int8, int4[:GROUP], fp8 or mxfp4 (the kernels "
                             "dequantize each slice they pack; the loop baseline keeps bf16)")
    parser.add_argument("--loop-only", action="store_true", help=argparse.SUPPRESS)  # the baseline's child
    args = parser.parse_args()
    cases = [(shape, int(tokens), kind) for shape in args.shapes.split(",") for tokens in args.tokens.split(",")
             for kind in args.routing.split(",")]
    if args.loop_only:
        print(json.dumps({f"{shape}/{tokens}/{kind}": loop_times(shape, tokens, kind, args.rank)
                          for shape, tokens, kind in cases}))
        return
    tuning = _ops.KernelTuning()
    if args.task_shape:
        shape = [int(v) for v in args.task_shape.split(",")]
        fields = ("panels_per_task", "grad_columns_per_task", "rows_per_task", "block_rows")
        if not 2 <= len(shape) <= 4:
            parser.error(f"--task-shape takes 2 to 4 integers, got {args.task_shape!r}")
        for field, value in zip(fields, shape):
            setattr(tuning, field, value)
        try:
            tuning.check()
        except ValueError as error:
            parser.error(str(error))

    isa = _ops.best_isa() if args.isa == "auto" else args.isa
    native = NativeExperts(isa, prepack=args.prepack, tuning=tuning)
    print(f"isa {isa}, {_ops.num_threads()} threads, cpu {_ops.cpu_features()['brand'].strip()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} (loop: {_STARTED_WITH_OMP_POLICY or 'unset'})")
    baseline = None if args.no_baseline else loop_baseline(args)
    # Each CPU alone first: right after an all-thread AMX job a core's single-thread rate can read about half its
    # own for a while, as if its clock had not come back up yet.
    unit = "amx" if isa == "amx" else "avx512_bf16" if isa == "avx512_bf16" else None
    cpu_text = describe_cpu_peaks(unit, per_cpu_peaks(unit)) if unit else ""
    print(cpu_text)
    peaks = measure_peaks()
    print("register-only peaks, TFLOP/s:", {k: round(v / 1e12, 3) for k, v in peaks.items()})
    state_before = {"copy": copy_bandwidth(), **peaks}
    rows = []
    for shape, tokens, kind in cases:
        row = run_case(shape, tokens, kind, args.rank, args.reps, native, baseline, args.expert_format)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    state_text = describe_host_state(state_before, {"copy": copy_bandwidth(), **measure_peaks()})
    print(state_text)
    for row in rows:
        uniform = [r for r in rows if r["shape"] == row["shape"] and r["tokens"] == row["tokens"]
                   and r["routing"] == "uniform"]
        if uniform:
            total = row["forward_ms"] + row["backward_ms"]
            row["skew_ratio"] = total / (uniform[0]["forward_ms"] + uniform[0]["backward_ms"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"cpu_experts_{isa}" + ("" if args.expert_format == "bf16" else f"_{args.expert_format.replace(':', '_')}")
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    columns = ["shape", "tokens", "routing", "forward_ms", "backward_ms", "best_ms", "target_ms", "forward_tflops",
               "backward_tflops", "forward_gbps", "dram_floor_ms", "skew_ratio", "loop_forward_ms", "loop_backward_ms",
               "speedup", "weights_gb", "scratch_gb"]
    peak_all = peaks.get(f"{isa}_all")
    for row in rows:
        if peak_all:
            row["efficiency"] = max(row["forward_tflops"], row["backward_tflops"]) * 1e12 / peak_all
    columns.append("efficiency")
    peak_text = ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in peaks.items()) or "none measured"
    knobs = "".join(f" --{name.replace('_', '-')} {value}" for name, value in
                    (("task_shape", args.task_shape),) if value is not None)
    knobs += " --prepack" if args.prepack else ""
    knobs += "".join(f" --{name.replace('_', '-')} {getattr(args, name)}" for name in ("routing", "rank", "reps",
                                                                                         "expert_format")
                     if getattr(args, name) != parser.get_default(name))
    knobs += " --no-baseline" if args.no_baseline else ""
    lines = [f"`python benchmarks/bench_cpu_experts.py --shapes {args.shapes} --tokens {args.tokens} "
             f"--isa {args.isa}{knobs}` ({isa}, {_ops.num_threads()} threads; kernels under "
             f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, the loop under "
             f"{_STARTED_WITH_OMP_POLICY or 'the OpenMP default'})", "",
             f"Register-only peaks (bf16; avx512_fma: float32): {peak_text}. efficiency = best pass TFLOP/s / the "
             f"{isa} all-thread peak.",
             *([cpu_text] if cpu_text else []),
             state_text,
             "weights_gb: the layer's expert weights, read in place (no packed or transposed copy"
             + ("; with --prepack a packed copy of the same size besides, not in scratch_gb" if args.prepack else "")
             + "); scratch_gb: resident memory the kernels added (scratch per routed pair, shared by all layers, "
             "plus this layer's saved activations).",
             "target_ms = half of forward + backward of the best public CPU MoE fine-tuning kernel on a 16-core Xeon "
             "with AMX (Qwen3 shape, Zipf routing); compare with forward_ms + backward_ms (medians over the reps). "
             "best_ms = the fastest forward plus the fastest backward rep.",
             "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                       for c in columns) + " |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in args.shapes.split(","):
        for kind in args.routing.split(","):
            sel = [r for r in rows if r["shape"] == shape and r["routing"] == kind]
            ax.plot([r["tokens"] for r in sel], [r["forward_ms"] + r["backward_ms"] for r in sel], marker="o",
                    label=f"moecc {shape} {kind}")
            if sel and "loop_forward_ms" in sel[0]:
                ax.plot([r["tokens"] for r in sel], [r["loop_forward_ms"] + r["loop_backward_ms"] for r in sel],
                        linestyle="--", marker="x", label=f"PyTorch loop {shape} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per layer call")
    ax.set_ylabel("forward + backward time per layer (ms)")
    ax.set_title(f"CPU experts, one layer, LoRA r={args.rank} ({isa})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
