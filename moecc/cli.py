"""The ``moecc`` command line. Library code never parses arguments; this module does.

    moecc info      CPU features and kernel ISA, threads, GPU, library versions
    moecc bench     time training steps per paradigm on a real-shaped random model; table, JSON, plots
    moecc plan      predict each paradigm's step time from measured machine rates; the crossover point

Arguments are checked before anything is measured or built (exit status 2 with the argument named). ``moecc
bench`` exits 1 when no row could be timed and 3 when some could not, listing each failed row.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys


EXIT_ALL_ROWS_FAILED = 1
EXIT_SOME_ROWS_FAILED = 3
PARADIGM_NAMES = ("cocompute", "offload", "hybrid", "gpu", "hf-offload")  # moecc.bench.runner.PARADIGMS


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number greater than 0")
    return value


def token_counts(text: str) -> list[int]:
    """argparse type: comma-separated token counts per step, each >= 1 (e.g. ``512,2048``)."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts separated by commas, e.g. 512,2048")
    return [positive_int(part) for part in parts]


def paradigm_list(text: str) -> list[str]:
    """argparse type: comma-separated paradigm names."""
    names = [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in PARADIGM_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown paradigm {unknown[0]!r}; choose from {', '.join(PARADIGM_NAMES)}")
    return names


def info() -> dict:
    """What this machine offers moecc: CPU features, the kernel ISA ``auto`` picks, threads, GPU, versions."""
    import peft
    import torch
    import transformers

    from . import __version__, _ops

    features = _ops.cpu_features()
    gpu = "none"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return {
        "moecc": __version__,
        "cpu": features.pop("brand").strip() or platform.processor(),
        "cpu_features": ", ".join(name for name, present in features.items() if present) or "none",
        "kernel_isa": _ops.best_isa(),
        "amx_self_check": _describe_amx_check(_ops.amx_self_check()),
        "threads": _ops.num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (torch's OpenMP threads spin; see README)",
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def _describe_amx_check(check: dict) -> str:
    if not check["ran"]:
        return f"not run: {check['reason']}"
    return "passed" if check["ok"] else f"FAILED: {check['reason']}"


def bench(args: argparse.Namespace) -> list[dict]:
    """Runs ``moecc bench``: every paradigm at every token count, each paradigm in a process of its own, writing
    the report after each."""
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from .bench.report import write_report
    from .bench.runner import PARADIGMS, run_case_isolated

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens, paradigms = args.tokens, args.paradigms
    assert set(PARADIGM_NAMES) == set(PARADIGMS), "cli.PARADIGM_NAMES is out of date"
    from .bench.plan import predict
    from .bench.rates import measure
    from .config import MoeccConfig

    if args.split_policy is not None:  # each paradigm's process reads it from the environment, as users set it
        from .paradigms.split_policies import split_policy

        split_policy(args.split_policy)  # an unknown name is refused here, before any run
        os.environ["MOECC_SPLIT_POLICY"] = args.split_policy
    rates = measure()
    slots = MoeccConfig.from_env().offload_slots  # what the bench's engines get
    command = "moecc bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])
    layers = "all layers" if args.layers is None else f"{args.layers} layer" + ("s" if args.layers != 1 else "")
    title = f"{args.preset}, {layers}, LoRA r={args.rank}, {device}"
    rows: list[dict] = []
    for paradigm in tqdm(paradigms, desc="paradigms", unit="paradigm"):
        new_rows = run_case_isolated(args.preset, args.layers, paradigm, tokens, args.steps, args.rank, device,
                                     args.gpu_budget, args.checkpointing, args.row_seconds, args.warmup)
        for row in new_rows:
            row["predicted_step_s"] = predict(args.preset, row.get("tokens_timed", row["tokens"]), rates, args.layers,
                                              args.rank, checkpointing=bool(row.get("checkpointing")),
                                              offload_lora_on_device=row.get("lora_on_device", True),
                                              offload_slots=slots).get(row["paradigm"])
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows += new_rows
        # After each paradigm: a run cut short keeps what it measured.
        files = write_report(rows, Path(args.out), title, command, dict(rates))
    print("wrote", ", ".join(str(f) for f in files))
    return rows


def plan(args: argparse.Namespace) -> dict:
    """Runs ``moecc plan``: rates (measured or cached), predicted step time per paradigm, the crossover."""
    from .bench.plan import auto_paradigm, crossover, describe, hybrid_plan, predict
    from .bench.presets import preset_config
    from .bench.rates import RANK, measure
    from .config import MoeccConfig

    rates = measure(remeasure=args.remeasure)
    slots = MoeccConfig.from_env().offload_slots
    print("machine rates:", {k: round(v, 2) for k, v in rates.items() if k != "shapes"})
    rank = getattr(args, "rank", RANK)
    table = {}
    for count in args.tokens:
        table[count] = predict(args.preset, count, rates, args.layers, rank, offload_slots=slots)
        print(f"{count:>7} tokens/step: " + ", ".join(f"{p} {s:.3f} s" for p, s in table[count].items()))
        for phase, split in hybrid_plan(args.preset, count, rates, args.layers, rank).items():
            print(f"          hybrid {phase}: {split['gpu_experts']} of {split['routed_experts']} routed experts "
                  f"on the GPU ({split['side']}); per layer CPU {1e3 * split['cpu_s']:.1f} ms, link "
                  f"{1e3 * split['link_s']:.1f} ms, GPU {1e3 * split['gpu_s']:.1f} ms")
    print(f"timed on one {args.preset} MoE layer, forward + backward:", *describe(args.preset, rates), sep="\n")
    point = crossover(args.preset, rates, args.layers, rank=rank, offload_slots=slots)
    if "gpu_tflops" not in rates:
        print("no GPU here: only co-compute (everything on the CPU) applies")
    else:
        print("offload overtakes co-compute at", f"~{point} tokens per step" if point else "no batch size tried")
        picked = auto_paradigm(preset_config(args.preset, args.layers), rates, slots)
        if picked is not None:
            print(f"paradigm='auto' picks {picked[0]!r} for this model: {picked[1]}")
    return {"rates": rates, "predictions": table, "crossover_tokens": point}


def failed_rows(rows: list[dict]) -> list[dict]:
    """The rows ``moecc bench`` could not time (a row with times and a caveat counts as timed)."""
    return [row for row in rows if "step_s" not in row]


def bench_exit_status(rows: list[dict]) -> int:
    """0 when every row was timed, 3 when some were not, 1 when none was; each failure goes to stderr."""
    failed = failed_rows(rows)
    for row in failed:
        print(f"moecc bench: {row.get('paradigm')} at {row.get('tokens')} tokens failed: {row.get('error')}",
              file=sys.stderr)
    if not failed:
        return 0
    print(f"moecc bench: {len(failed)} of {len(rows)} rows failed", file=sys.stderr)
    return EXIT_ALL_ROWS_FAILED if len(failed) == len(rows) else EXIT_SOME_ROWS_FAILED


def _check_preset(parser: argparse.ArgumentParser, preset: str) -> None:
    from .bench.presets import PRESETS

    if preset not in PRESETS:
        parser.error(f"argument --preset: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moecc", description="LoRA fine-tuning of MoE models with CPU experts",
                                     epilog="exit status: 0 done, 2 bad arguments; bench: 1 no row timed, "
                                            "3 some rows not timed")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="CPU features and kernel ISA, threads, GPU, versions")
    bench_parser = commands.add_parser("bench", help="compare paradigms on a real-shaped random model")
    bench_parser.add_argument("--preset", default="qwen3-30b-a3b",
                              help="qwen3-30b-a3b, deepseek-v2-lite, olmoe-1b-7b, mixtral-8x7b, gpt-oss-20b, tiny")
    bench_parser.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: all)")
    bench_parser.add_argument("--tokens", type=token_counts, default="512,2048,8192",
                              help="tokens per step, comma-separated")
    bench_parser.add_argument("--paradigms", type=paradigm_list, default="cocompute,offload,hybrid,gpu,hf-offload",
                              help="comma-separated: cocompute, offload, hybrid (experts split between CPU and "
                                   "GPU per layer), gpu (whole model on the GPU), "
                                   "hf-offload (PEFT + accelerate's CPU offload of the experts)")
    bench_parser.add_argument("--gpu-budget", type=positive_float, default=24.0, help="GPU memory budget in GB")
    bench_parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per row")
    bench_parser.add_argument("--warmup", type=positive_int, default=4,
                              help="untimed steps before each row's (hybrid's split settles over its first steps; "
                                   "fewer where they take longer than --row-seconds)")
    bench_parser.add_argument("--row-seconds", type=positive_float, default=20.0,
                              help="time fewer steps (at least one) where --steps of them would take longer")
    bench_parser.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"],
                              help="Hugging Face gradient checkpointing: auto = turned on for a paradigm once a token "
                                   "count runs out of GPU memory (each row says whether it was on)")
    bench_parser.add_argument("--rank", type=positive_int, default=8)
    bench_parser.add_argument("--split-policy", default=None,
                              help="hybrid's split policy (MoeccConfig.split_policy): planned (default) or "
                                   "coldest:SHARE (the least-routed experts on the CPU up to SHARE of the bytes)")
    bench_parser.add_argument("--out", default="./moecc-bench",
                              help="folder for bench.md, bench.json and the plots (default: ./moecc-bench)")
    plan_parser = commands.add_parser("plan", help="predict each paradigm's step time on this machine")
    plan_parser.add_argument("--preset", default="qwen3-30b-a3b")
    plan_parser.add_argument("--layers", type=positive_int, default=None)
    plan_parser.add_argument("--tokens", type=token_counts, default="512,2048,8192")
    plan_parser.add_argument("--remeasure", action="store_true", help="measure the rates again")
    args = parser.parse_args(argv)
    if args.command in ("plan", "bench"):
        _check_preset(parser, args.preset)
    if args.command == "plan":
        plan(args)
    elif args.command == "info":
        for key, value in info().items():
            print(f"{key:>15}: {value}")
    elif args.command == "bench":
        return bench_exit_status(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
