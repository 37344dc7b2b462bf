"""Kernel knob settings against each other on one MoE layer, interleaved in one process.

A shared machine's speed can drift by tens of percent between runs, more than most knobs change. So this builds each case once and runs every setting once
per rep, in turn: drift hits all settings alike. It reports the best of --reps forward and backward per setting
and token count, the median of their sums, and a score: the geometric mean over token counts of the best
forward + backward against the built-in defaults (below 1: faster). Writes the table as markdown under --out.

A setting is NAME:KNOB=VALUES[/KNOB=VALUES...], the knobs being fields of the kernels' settings
(moecc._ops.KernelTuning, cpp/kernels/expert_ffn.h and panel_gemm.h):
  task=PANELS,GRAD_COLUMNS,ROWS,BLOCK_ROWS       (panels_per_task, grad_columns_per_task, rows_per_task, block_rows)
  copies=ON                                      (streaming_copies: non-temporal row copies)
  outputs=MASK                                   (streaming_outputs: 1 per-pair rows, 2 gate/up, 4 activation rows,
                                                  8 the down input gradient's rows)
  pack=ROWS_AHEAD,TO_L2                          (gemm.pack_prefetch_rows, gemm.pack_prefetch_l2; AVX512 and AMX)
  next=ON                                        (gemm.amx_prefetch_next; AMX only)
Knobs a setting leaves out keep their built-in values.

    python benchmarks/sweep_cpu_experts.py --setting narrow:task=8,256,1024,0 --setting l1:pack=16,0
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_experts import SHAPES, make_case  # noqa: E402  (imports moecc before torch)

from tqdm import tqdm  # noqa: E402

from moecc import _ops  # noqa: E402
from moecc.experts.native import NativeExperts  # noqa: E402

KNOBS = {"task": 4, "copies": 1, "outputs": 1, "pack": 2, "next": 1}


def parse_setting(text: str) -> tuple[str, dict[str, list[int]]]:
    """``NAME:KNOB=V,V/KNOB=V`` -> (name, {knob: values}); ValueError naming the problem otherwise."""
    name, sep, body = text.partition(":")
    if not sep or not name or not body:
        raise ValueError(f"setting {text!r}: expected NAME:KNOB=VALUES[/KNOB=VALUES...]")
    knobs: dict[str, list[int]] = {}
    for part in body.split("/"):
        knob, sep, values = part.partition("=")
        if not sep or knob not in KNOBS:
            raise ValueError(f"setting {name!r}: unknown knob in {part!r} (knobs: {', '.join(KNOBS)})")
        try:
            numbers = [int(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"setting {name!r}: {knob} takes integers, got {values!r}") from None
        if len(numbers) != KNOBS[knob]:
            raise ValueError(f"setting {name!r}: {knob} takes {KNOBS[knob]} values, got {len(numbers)}")
        knobs[knob] = numbers
    return name, knobs


def built_in() -> dict[str, list[int]]:
    """The knobs' built-in values: those of a fresh KernelTuning."""
    t = _ops.KernelTuning()
    return {"task": [t.panels_per_task, t.grad_columns_per_task, t.rows_per_task, t.block_rows],
            "copies": [int(t.streaming_copies)], "outputs": [t.streaming_outputs],
            "pack": [t.gemm.pack_prefetch_rows, int(t.gemm.pack_prefetch_l2)], "next": [int(t.gemm.amx_prefetch_next)]}


def tuning_of(knobs: dict[str, list[int]]) -> _ops.KernelTuning:
    """The kernel settings of one setting (every knob given), checked (ValueError naming a bad field)."""
    t = _ops.KernelTuning()
    t.panels_per_task, t.grad_columns_per_task, t.rows_per_task, t.block_rows = knobs["task"]
    t.streaming_copies = bool(knobs["copies"][0])
    t.streaming_outputs = knobs["outputs"][0]
    t.gemm.pack_prefetch_rows, t.gemm.pack_prefetch_l2 = knobs["pack"][0], bool(knobs["pack"][1])
    t.gemm.amx_prefetch_next = bool(knobs["next"][0])
    t.check()
    return t


def score(best: dict, name: str, tokens: list[int]) -> float:
    """Geometric mean over token counts of best forward + backward against the defaults'."""
    return math.exp(statistics.mean(math.log(sum(best[name, t]) / sum(best["default", t])) for t in tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", action="append", default=[], metavar="NAME:KNOB=VALUES[/...]")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--routing", default="zipf", choices=("uniform", "zipf"))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--isa", default="auto")
    parser.add_argument("--out", default="moecc-bench")
    args = parser.parse_args()
    try:
        parsed = [parse_setting(text) for text in args.setting]
    except ValueError as error:
        parser.error(str(error))
    if any(name == "default" for name, _ in parsed) or len({name for name, _ in parsed}) != len(parsed):
        parser.error("settings need distinct names other than 'default' (the built-in values)")
    defaults = built_in()
    settings = {"default": defaults} | {name: defaults | knobs for name, knobs in parsed}
    try:
        tunings = {name: tuning_of(knobs) for name, knobs in settings.items()}
    except ValueError as error:
        parser.error(str(error))
    tokens = [int(t) for t in args.tokens.split(",")]
    native = NativeExperts(_ops.best_isa() if args.isa == "auto" else args.isa)
    cases = {t: make_case(args.shape, t, args.routing, args.rank) for t in tokens}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in tqdm(range(args.reps), desc="reps", unit="rep"):
        for name in settings:
            native.tuning = tunings[name]
            for t in tokens:
                weights, gate_up, down, x, index, w, grad_out = cases[t]
                start = time.perf_counter()
                out, saved = native.forward(weights, x, index, w, gate_up, down)
                middle = time.perf_counter()
                grad = native.backward(weights, saved, grad_out, gate_up, down)[0]
                times.setdefault((name, t), []).append((middle - start, time.perf_counter() - middle))
                native.release_result(out)  # as co-compute does once they are on the device
                native.release_result(grad)
    best = {key: (min(f for f, _ in runs) * 1e3, min(b for _, b in runs) * 1e3) for key, runs in times.items()}
    lines = [f"`python benchmarks/sweep_cpu_experts.py {' '.join(sys.argv[1:])}` ({native.isa}, "
             f"{_ops.num_threads()} threads, {args.shape}, {args.routing} routing, best of {args.reps} interleaved "
             f"reps; default = task {defaults['task']}, copies {defaults['copies'][0]}, "
             f"outputs {defaults['outputs'][0]}, pack {defaults['pack']}, next {defaults['next'][0]})", "",
             "| setting | tokens | forward ms | backward ms | sum | median sum | score |",
             "|---|---|---|---|---|---|---|"]
    for name in settings:
        for t in tokens:
            median = statistics.median(f + b for f, b in times[name, t]) * 1e3
            lines.append(f"| {name} | {t} | {best[name, t][0]:.1f} | {best[name, t][1]:.1f} | "
                         f"{sum(best[name, t]):.1f} | {median:.1f} | {score(best, name, tokens):.3f} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu_experts_sweep_{native.isa}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
