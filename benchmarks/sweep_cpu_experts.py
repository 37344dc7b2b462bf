"""Kernel knob settings against each other on one MoE layer, interleaved in one process.

A shared host's speed drifts by 10-40% between runs (the AMX host's register-only peak read 13.7 to 21.3
TFLOP/s within one day), more than most knobs change. So this builds each case once and runs every setting once
per rep, in turn: drift hits all settings alike. It reports the best of --reps forward and backward per setting
and token count, the median of their sums, and a score: the geometric mean over token counts of the best
forward + backward against the built-in defaults (below 1: faster). Writes the table as markdown under --out.

A setting is NAME:KNOB=VALUES[/KNOB=VALUES...], the knobs being the extension's setters:
  amx=K_BLOCK,PREFETCH_A,PREFETCH_B,K_BLOCK_GRAD   (moecc._C.set_amx_tuning; AMX only)
  group=ROWS                                     (moecc._C.set_amx_token_group; AMX only)
  next=ON                                        (moecc._C.set_amx_prefetch_next; AMX only)
  pack=ROWS_AHEAD,TO_L2                          (moecc._C.set_pack_prefetch; AVX512 and AMX)
  task=PANELS,GRAD_COLUMNS,ROWS,BLOCK_ROWS       (moecc._C.set_task_shape)
  copies=ON                                      (moecc._C.set_streaming_copies: non-temporal row copies)
  outputs=MASK                                   (moecc._C.set_streaming_outputs: 1 per-pair rows, 2 gate/up,
                                                  4 activation rows, 8 the down input gradient's rows)
  fetch=DISTANCE                                 (moecc._C.set_weight_fetch: tasks ahead whose weights a task
                                                  asks for from inside its products; 0 off; AVX512 and AMX)
  overlap=ON                                     (moecc._C.set_overlap_lora_grads: the LoRA factor gradients
                                                  among the gate/up input gradient's products)
Knobs a setting leaves out keep their built-in values.

    python benchmarks/sweep_cpu_experts.py --setting passes256:amx=256,64,0,1024/group=0 \\
        --setting narrow:task=8,256,1024,0
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

from moecc import _C, _ops  # noqa: E402
from moecc.experts.native import NativeExperts  # noqa: E402

KNOBS = {"amx": 4, "group": 1, "task": 4, "next": 1, "pack": 2, "copies": 1, "outputs": 1, "fetch": 1, "overlap": 1}


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
    """The knobs' current values (setting each to itself: the setters return what they replace)."""
    current = {"amx": list(_C.set_amx_tuning(0, 0, 0, 0)), "task": list(_C.set_task_shape(1, 16, 1, 0)),
               "group": [_C.set_amx_token_group(0)], "next": [_C.set_amx_prefetch_next(0)],
               "pack": list(_C.set_pack_prefetch(0, 0)), "copies": [int(_C.set_streaming_copies(False))],
               "outputs": [_C.set_streaming_outputs(0)], "fetch": [_C.set_weight_fetch(0)],
               "overlap": [int(_C.set_overlap_lora_grads(False))]}
    apply(current)
    return current


def apply(knobs: dict[str, list[int]]) -> None:
    _C.set_amx_tuning(*knobs["amx"])
    _C.set_task_shape(*knobs["task"])
    _C.set_amx_token_group(*knobs["group"])
    _C.set_amx_prefetch_next(*knobs["next"])
    _C.set_pack_prefetch(*knobs["pack"])
    _C.set_streaming_copies(bool(knobs["copies"][0]))
    _C.set_streaming_outputs(*knobs["outputs"])
    _C.set_weight_fetch(*knobs["fetch"])
    _C.set_overlap_lora_grads(bool(knobs["overlap"][0]))


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
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    try:
        parsed = [parse_setting(text) for text in args.setting]
    except ValueError as error:
        parser.error(str(error))
    if any(name == "default" for name, _ in parsed) or len({name for name, _ in parsed}) != len(parsed):
        parser.error("settings need distinct names other than 'default' (the built-in values)")
    defaults = built_in()
    settings = {"default": defaults} | {name: defaults | knobs for name, knobs in parsed}
    tokens = [int(t) for t in args.tokens.split(",")]
    native = NativeExperts(_ops.best_isa() if args.isa == "auto" else args.isa)
    cases = {t: make_case(args.shape, t, args.routing, args.rank) for t in tokens}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for _ in tqdm(range(args.reps), desc="reps", unit="rep"):
            for name, knobs in settings.items():
                apply(knobs)
                for t in tokens:
                    weights, gate_up, down, x, index, w, grad_out = cases[t]
                    start = time.perf_counter()
                    out, saved = native.forward(weights, x, index, w, gate_up, down)
                    middle = time.perf_counter()
                    grad = native.backward(weights, saved, grad_out, gate_up, down)[0]
                    times.setdefault((name, t), []).append((middle - start, time.perf_counter() - middle))
                    native.release_result(out)  # as co-compute does once they are on the device
                    native.release_result(grad)
    finally:
        apply(defaults)
    best = {key: (min(f for f, _ in runs) * 1e3, min(b for _, b in runs) * 1e3) for key, runs in times.items()}
    lines = [f"`python benchmarks/sweep_cpu_experts.py {' '.join(sys.argv[1:])}` ({native.isa}, "
             f"{_ops.num_threads()} threads, {args.shape}, {args.routing} routing, best of {args.reps} interleaved "
             f"reps; default = amx {defaults['amx']}, task {defaults['task']}, group {defaults['group'][0]}, "
             f"next {defaults['next'][0]}, pack {defaults['pack']}, copies {defaults['copies'][0]}, "
             f"outputs {defaults['outputs'][0]}, fetch {defaults['fetch'][0]}, overlap {defaults['overlap'][0]})", "",
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
